"""How a node's llama.cpp threads wait: libgomp's spin, set before llama.cpp loads.

llama-cpp-python's llama.cpp is built with OpenMP (libggml-cpu links libgomp),
so a ``llama_decode`` on n threads is one OpenMP parallel region, and ggml's
barriers between a graph's operations are OpenMP barriers. libgomp makes a
waiting thread spin ``GOMP_SPINCOUNT`` rounds before it sleeps, both at those
barriers and, once the region is over, while it waits for the next one. Its
default (300,000 rounds, ~3 ms) suits one process that has the machine to
itself, as the whole model in ``Llama`` does. It does not suit two hops of a
route on one machine: the hop that just finished keeps a core spinning for
milliseconds while the next hop computes on all of them. Measured on 2 vCPUs
with a bare pipe between head and tail (``python -m bench.interference
--threads 2 [--spin N]``; docs/performance.md, "Threads"): 42 tok/s with the
default spin, 70-89 with 10,000 rounds, beside 76-87 for the whole model.

A node's decode steps run on the data plane's thread (two thread wake-ups a
step and hop fewer than on the executor's worker) while its prompt chunks run
on the worker: two threads that each own a team. libgomp then counts more
threads than cores and cuts every wait to its *throttled* spin, 100 rounds
when ``OMP_WAIT_POLICY`` is unset (every barrier of every graph sleeps and
wakes: 140 context switches a token, decode at a third of its speed), and
``min(1000, GOMP_SPINCOUNT)`` under ``OMP_WAIT_POLICY=active``. On a host
where a barrier's wait outlasts 1,000 rounds (~10 µs) that still sleeps ~50
times a token and hop (measured on a slower host: 52 voluntary switches a
token on each compute thread). So the worker gives its team back whenever it
goes idle (``release_team``): while a session decodes, the data plane's team
is the only one, libgomp does not throttle, and its waits spin
``GOMP_SPINCOUNT``: 2-3 switches a token, and the route 0.796 against 0.718
of the whole model, in turn, ahead in 4 of 4 rounds (``python -m
bench.nodeenv``; docs/performance.md).

A round costs 25-30 ns here, so after every graph a hop's partner thread
spins on for 10,000 rounds ~0.25 ms of a core, 2,000 ~0.05 ms (a bare
OpenMP region, CPU time per idle wait: ``docs/performance.md``, "The spin
after a graph"); on two shared cores that core is the one the next hop
starts computing on. 2,000 rounds were ahead of 10,000 in 12 of 15 rounds in
turn over two sessions (``python -m bench.nodeenv --variant default
--variant spin10k:GOMP_SPINCOUNT=10000``), by 1-7%, and behind in 3 by 4-11%;
500 rounds lost 5% (the graph's own barriers start to sleep), so the node
sets 2,000. (``.ci/install`` builds llama.cpp without OpenMP, where none of
this applies: a context's own ggml pool sleeps after each graph; this is
for a node on PyPI's OpenMP build.)
The policy stays ``active`` for the moments both teams live (a prompt chunk
beside another session's decode).

libgomp reads these variables once, when it is loaded (``import llama_cpp``),
so ``configure`` runs at the very start of a node process; values the user
set are kept, and ``teams_keep_their_spin`` tells the executor whether a
second team is safe under them where teams cannot be given back.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable

#: libgomp spin rounds before a waiting thread sleeps (~0.05 ms here): long enough for the barriers between
#: the operations of one graph on a slow or shared core, short enough that a hop's idle threads are asleep
#: soon after the next hop starts computing. It holds while one team lives in the process (the worker gives
#: its team back when it goes idle, ``release_team``); two teams cut it to libgomp's throttled spin
SPIN_ROUNDS = 2_000
#: the wait policy under which a second OpenMP team keeps (nearly) the same spin as one
WAIT_POLICY = "active"

log = logging.getLogger("meshnode.node")


def configure(decode_threads: int, environ: dict[str, str] | None = None) -> str | None:
    """For a node that decodes on several threads, set ``GOMP_SPINCOUNT`` and ``OMP_WAIT_POLICY`` unless
    the user did; returns the spin in force (None: libgomp's default). A single-threaded decode starts no
    OpenMP team, and prompt chunks are long enough that the default spin costs nothing there.

    Too late once llama.cpp is loaded (libgomp has read its environment): logged, not raised.
    """
    env = os.environ if environ is None else environ
    if decode_threads <= 1:
        return env.get("GOMP_SPINCOUNT")
    value = env.setdefault("GOMP_SPINCOUNT", str(SPIN_ROUNDS))
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if environ is None and "llama_cpp" in sys.modules:
        log.warning("llama.cpp was loaded before GOMP_SPINCOUNT was set; its threads spin libgomp's default")
    return value


def teams_keep_their_spin(environ: dict[str, str] | None = None) -> bool:
    """Whether a second OpenMP team in this process leaves libgomp's waits as they are: under a wait policy
    (active: the throttled spin is min(1000, GOMP_SPINCOUNT); passive: no spin to cut). Unset, libgomp cuts
    every wait to 100 rounds as soon as two threads own teams."""
    env = os.environ if environ is None else environ
    return env.get("OMP_WAIT_POLICY", "").strip().lower() in ("active", "passive")


#: libgomp's ``omp_pause_resource_all`` (None: none here), looked up once llama.cpp is loaded
_found: list[Callable[[int], int] | None] = []


def _pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` in this process, None if llama.cpp brought no libgomp with it
    (or is not loaded yet: libgomp comes with it, so the answer is kept only from then on)."""
    if _found:
        return _found[0]
    if "llama_cpp" not in sys.modules:
        return None
    fn = _look_up_pause()
    _found.append(fn)
    return fn


def _look_up_pause() -> Callable[[int], int] | None:
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split() for line in maps]
    except OSError:
        return None
    for path in sorted({f[5] for f in fields if len(f) >= 6 and os.path.basename(f[5]).startswith("libgomp")}):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all  # already loaded: the same library, not a second
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def can_release_teams() -> bool:
    """Whether ``release_team`` works here (llama.cpp's libgomp is loaded and has OpenMP 5's pause)."""
    return _pause() is not None


def release_team() -> None:
    """Give back the OpenMP team the calling thread started (its threads end), if it has one.

    libgomp keeps a team for every thread that ever started a parallel region, and once it manages more
    threads than the process has CPUs it cuts every wait of every team to its throttled spin
    (``min(1000, GOMP_SPINCOUNT)`` under ``OMP_WAIT_POLICY=active``, 100 without). A node's worker runs
    prompt chunks on a team of its own while decode steps run on the data plane's: the worker calls this
    whenever it goes idle, so the data plane's team is the only one while the session decodes and keeps
    the full spin. ``omp_pause_resource_all(omp_pause_soft)`` frees only the caller's team; the next
    region on this thread starts a new one (tens of µs, once a prompt chunk).
    """
    fn = _pause()
    if fn is not None:
        fn(1)  # omp_pause_soft


#: the kernel's name of the executor's worker thread, and so of its OpenMP team (``top -H``, /proc/PID/task)
WORKER_NAME = "meshnode-llama"


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) where the kernel shows it; threads it starts,
    an OpenMP team's among them, inherit it. Python's own thread names stay inside Python."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is cosmetic
        pass
