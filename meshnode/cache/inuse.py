"""Which cached model files and ranges a running node is using: a shared lock it holds while it runs.

A node holds ``.inuse`` (a shared ``flock``) in the directory of the range artifact it serves and of
the fetched model it serves bytes of, for as long as its process lives (the kernel drops the lock when
it exits, however it exits). ``model ls`` shows those as served, and ``model rm`` and the cache limit
never remove them. The lock file's mtime is when a node last took it: the cache evicts least recently
used first.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK = ".inuse"
#: held by this process: fd per directory (kept open until exit)
_HELD: dict[Path, int] = {}


def hold(directory: Path) -> None:
    """Hold ``directory`` as in use by this process until it exits (idempotent)."""
    d = directory.resolve()
    if d in _HELD:
        return
    path = d / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.utime(path)  # last used: now
    _HELD[d] = fd


def in_use(directory: Path) -> bool:
    """Whether some process holds ``directory`` (this one included)."""
    d = directory.resolve()
    if d in _HELD:
        return True
    try:
        fd = os.open(d / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def last_used(directory: Path) -> float:
    """When a node last took the directory (else when it was made), seconds since the epoch."""
    for p in (directory / LOCK, directory / "manifest.json", directory):
        try:
            return p.stat().st_mtime
        except OSError:
            continue
    return 0.0
