"""Keep a hop's CPU awake between decode steps, for a while (native/linger.c says why).

After each ``llama_decode`` a range lingers: a thread of its own (C, at SCHED_IDLE, never holding
the GIL) spins until the next step comes or ``window`` runs out. It costs the CPU of an otherwise idle
core, at most ``cap`` seconds after a range's last step. Where other work wants the cores while the
range waits (the other hops of a route on the same machine), the core would not idle anyway, and a
spinner there measured ~4% slower routes: so a linger that got less than ``SHARE`` of its time on a
core stops lingering for ``REST`` steps, then tries again. ``window`` and ``worth`` are the decisions,
pure functions.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

from meshnode.errors import ExecutorError, InputError

#: the most seconds a range lingers after a step (``MESHNODE_LINGER``): covers the other hops' step of
#: a dense model of several GB on one core; after a generation's last step a hop spins at most this long
CAP = 1.0
#: a linger that had a core for less of its time than this shared it with other work
SHARE = 0.5
#: steps without lingering after lingers that shared their core, before the next try
REST = 64
#: lingers are judged once they add up to this much time (seconds)
JUDGED = 0.005


def window(gap: float | None, cap: float) -> float:
    """Seconds to linger after a step: twice the last gap between two steps (the next step comes
    about that late again), at most ``cap``; none before a gap is known, or with ``cap`` 0."""
    if gap is None or cap <= 0:
        return 0.0
    return min(cap, 2.0 * max(gap, 0.0))


def worth(cpu: float, wall: float) -> bool | None:
    """Whether lingers that took ``wall`` seconds, ``cpu`` of them on a core, had their core to themselves
    (the core would have idled without them): None while under ``JUDGED`` seconds have been measured."""
    if wall < JUDGED:
        return None
    return cpu >= SHARE * wall


def check_cap(raw: str | float, name: str) -> float:
    """Seconds from 0 (never linger) to 10, or InputError naming ``name``."""
    try:
        cap = float(raw)
    except ValueError:
        cap = -1.0
    if not 0.0 <= cap <= 10.0:  # also NaN
        raise InputError(f"{name} must be seconds from 0 (never linger) to 10, not {raw!r}")
    return cap


def cap_from_env() -> float:
    """``MESHNODE_LINGER``; unset: ``CAP``."""
    raw = os.environ.get("MESHNODE_LINGER")
    return CAP if raw is None else check_cap(raw, "MESHNODE_LINGER")


@functools.cache
def _lib() -> ctypes.CDLL:
    from meshnode.executor._bindings import native_library

    lib = ctypes.CDLL(str(native_library("_linger")))
    lib.mn_linger_new.restype = ctypes.c_void_p
    lib.mn_linger_new.argtypes = []
    lib.mn_linger_idle.restype = None
    lib.mn_linger_idle.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.mn_linger_busy.restype = None
    lib.mn_linger_busy.argtypes = [ctypes.c_void_p]
    lib.mn_linger_counts.restype = None
    lib.mn_linger_counts.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64 * 4)]
    lib.mn_linger_free.restype = None
    lib.mn_linger_free.argtypes = [ctypes.c_void_p]
    return lib


class Linger:
    """One range's between-steps spinner: ``busy()`` as a step starts, ``idle()`` when it ends.

    Not thread-safe: the range's caller serialises steps, as it does for llama.cpp itself."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self._handle: int | None = None
        self._ended: float | None = None  # monotonic time the last step ended
        self._gap: float | None = None
        self._judged = (0, 0)  # (wall, cpu) ns of the lingers judged so far
        #: steps left without lingering (lingers shared their core)
        self.resting = 0
        if cap > 0:
            self._handle = _lib().mn_linger_new()
            if not self._handle:
                raise ExecutorError("could not start the linger thread")

    def busy(self) -> None:
        if self._handle:
            _lib().mn_linger_busy(self._handle)
        if self._ended is not None:
            self._gap = time.monotonic() - self._ended

    def idle(self) -> None:
        now = time.monotonic_ns()
        self._ended = now / 1e9
        if not self._handle:
            return
        _, _, wall, cpu = self._counts()
        verdict = worth((cpu - self._judged[1]) / 1e9, (wall - self._judged[0]) / 1e9)
        if verdict is not None:  # the lingers since the last verdict
            self.resting = 0 if verdict else REST
            self._judged = (wall, cpu)
        if self.resting:
            self.resting -= 1
        elif (w := window(self._gap, self.cap)) > 0:
            _lib().mn_linger_idle(self._handle, now + int(w * 1e9))

    def _counts(self) -> tuple[int, int, int, int]:
        out = (ctypes.c_uint64 * 4)()
        _lib().mn_linger_counts(self._handle, ctypes.byref(out))
        return int(out[0]), int(out[1]), int(out[2]), int(out[3])

    def counts(self) -> tuple[int, int]:
        """Lingers so far that (the next step ended, the deadline ended)."""
        return self._counts()[:2] if self._handle else (0, 0)

    def cpu_share(self) -> float | None:
        """Of all lingers' time so far, the share the spinner had a core (None before any)."""
        if not self._handle:
            return None
        _, _, wall, cpu = self._counts()
        return cpu / wall if wall else None

    def close(self) -> None:
        if self._handle:
            _lib().mn_linger_free(self._handle)
            self._handle = None
