"""A node's runtime files in its state directory: the single-instance lock and ``node.json``.

    <state dir>/node.lock   flock(LOCK_EX) held by the running node for its whole life, and
                            its pid; the kernel drops the lock when the process ends, however
                            it ends, so there is no stale pid to second-guess
    <state dir>/node.json   what ``leave`` and ``status`` need (pid, listen address, endpoint,
                            tracker, ...), written once the node serves

Which state directory a node gets when none is given (``default_state_dir``): the
default one (``~/.local/state/meshnode``) for a node on an ephemeral port, and
``<default>/nodes/<host>_<port>`` for a node on a fixed ``--listen`` address, so
several nodes on one machine each keep their own key across restarts, the way
several llama-server instances on their own ports just work. ``find_nodes``
looks in exactly those places.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshnode.errors import InputError
from meshnode.runtime import paths

LOCK_FILE = "node.lock"
INFO_FILE = "node.json"
#: under the default state dir: one sub-directory per fixed listen address
NODES_DIR = "nodes"
#: a probe (``status``) holds the lock for microseconds; a claim retries this long before giving up
CLAIM_RETRY_SECONDS = 1.0


def address_key(host: str, port: int) -> str:
    """``127.0.0.1:7002`` -> ``127.0.0.1_7002``: a listen address as a directory name. Pure."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", host) + f"_{port}"


def default_state_dir(base: Path, host: str, port: int) -> Path:
    """The state dir of a node given none: ``base`` on port 0, else ``base/nodes/<host>_<port>``. Pure."""
    return base if port == 0 else base / NODES_DIR / address_key(host, port)


def node_state_dir(explicit: Path | None, host: str, port: int) -> tuple[Path, str]:
    """The state dir a node uses, and what to tell its user if another node holds it.

    ``explicit`` (``--state-dir``) or systemd's ``$STATE_DIRECTORY`` is used as given: one
    unit, one node. Otherwise ``default_state_dir`` of the default state directory.
    """
    if explicit is not None:
        return explicit, "give this node its own --state-dir"
    if os.environ.get("STATE_DIRECTORY"):
        return paths.state_dir(), "give this node its own --state-dir (systemd's StateDirectory= is taken)"
    base = paths.state_dir()
    if port == 0:
        return base, (f"give this node a fixed --listen HOST:PORT (each gets its own state dir under "
                      f"{base / NODES_DIR}) or its own --state-dir")
    return default_state_dir(base, host, port), f"a node was started with --listen {host}:{port} already; " \
        "give this one another --listen or its own --state-dir"


@dataclass(frozen=True)
class Running:
    """A node found holding a state dir's lock."""

    #: the state directory it holds
    state_dir: Path
    #: its pid (from the lock file)
    pid: int
    #: its node.json, or None while it is still starting (locked, not serving yet)
    info: dict[str, Any] | None

    def matches(self, listen: str) -> bool:
        """Whether this node was started with, or is bound to, ``listen``."""
        return self.info is not None and listen in (self.info.get("listen"), self.info.get("endpoint"))

    def describe(self) -> str:
        where = self.info.get("endpoint") if self.info else "starting"
        return f"pid {self.pid}, {where}"


def _read_pid(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def probe(sdir: Path) -> Running | None:
    """The node holding ``sdir``'s lock, or None if none does (taking and dropping a shared lock)."""
    path = sdir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(path)
        return Running(sdir, pid, _read_info(sdir, pid))
    finally:
        os.close(fd)  # also drops the shared lock if it was taken
    return None


def _read_info(sdir: Path, pid: int) -> dict[str, Any] | None:
    """node.json if it was written by ``pid`` (a node that died unclean leaves an old one behind)."""
    try:
        doc = json.loads((sdir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return dict(doc) if isinstance(doc, dict) and doc.get("pid") == pid else None


def find_nodes(base: Path) -> list[Running]:
    """Every running node whose state dir is ``base`` or one of its per-address sub-dirs."""
    dirs = [base, *sorted(p for p in (base / NODES_DIR).glob("*") if p.is_dir())]
    return [r for r in map(probe, dirs) if r is not None]


class RuntimeDir:
    """The running node's hold on its state dir: the lock (``claim``), then node.json (``write``)."""

    def __init__(self, sdir: Path) -> None:
        self.dir = sdir
        self._fd: int | None = None

    def claim(self, *, hint: str) -> None:
        """Take the lock, or raise InputError naming the node that holds it and ``hint`` (what to do)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + CLAIM_RETRY_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    pid = _read_pid(self.dir / LOCK_FILE)
                    raise InputError(f"a node (pid {pid}) already runs with state dir {self.dir}: {hint}") from None
                time.sleep(0.05)  # a status probe holds it for microseconds
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def write(self, **info: object) -> None:
        """node.json, atomically (a reader never sees half of it)."""
        path = self.dir / INFO_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "state_dir": str(self.dir), **info}))
        tmp.replace(path)

    def release(self) -> None:
        """Remove node.json, then drop the lock (the lock file stays: unlinking it would race a claim)."""
        if self._fd is None:
            return
        if _read_info(self.dir, os.getpid()) is not None:
            (self.dir / INFO_FILE).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
