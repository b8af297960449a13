"""A memory cgroup of the caller's own: run node processes under a memory limit (issue 24, item 5).

``memory_cgroup(limit)`` makes a cgroup (v1 ``memory.limit_in_bytes``, or v2 ``memory.max``) under
the machine's memory controller, yields what a process is started under to run in it (``prefix``:
``sh -c 'echo $$ > cgroup.procs && exec "$@"'``), and removes it afterwards (its processes must have
ended). ``peak`` and ``events`` read what the cgroup saw: its peak usage, how often it hit the limit,
and OOM kills. Skips (``Unavailable``) on a machine with no writable memory controller.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


class Unavailable(Exception):
    """This machine gives no writable memory cgroup."""


@dataclass(frozen=True)
class MemCap:
    dir: Path
    version: int
    limit: int

    @property
    def prefix(self) -> list[str]:
        """A command line's start that runs the rest of it inside this cgroup."""
        return ["sh", "-c", f'echo $$ > {self.dir / "cgroup.procs"} && exec "$@"', "sh"]

    def peak(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.dir / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def events(self) -> dict[str, int]:
        """v1: {"failcnt": times the limit was hit, "oom_kill": ...}; v2: memory.events."""
        out: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            if self.version == 1:
                out["failcnt"] = int((self.dir / "memory.failcnt").read_text())
                for line in (self.dir / "memory.oom_control").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        out["oom_kill"] = int(v)
            else:
                for line in (self.dir / "memory.events").read_text().splitlines():
                    k, _, v = line.partition(" ")
                    out[k] = int(v)
        return out


def _make(limit: int) -> MemCap:
    name = f"meshnode-cap-{uuid.uuid4().hex[:8]}"
    if (V1 / "memory.limit_in_bytes").exists() and os.access(V1, os.W_OK):
        d = V1 / name
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(limit))
        return MemCap(d, 1, limit)
    for root in V2_ROOTS:
        ctl = root / "cgroup.subtree_control"
        if ctl.exists() and "memory" in ctl.read_text().split() and os.access(root, os.W_OK):
            d = root / name
            d.mkdir()
            (d / "memory.max").write_text(str(limit))
            return MemCap(d, 2, limit)
    raise Unavailable("no writable memory cgroup on this machine (cgroup v1 memory or v2 memory.max)")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemCap]:
    cap = _make(limit)
    try:
        yield cap
    finally:
        deadline = time.monotonic() + 10
        while True:  # the processes' exit is seen by the cgroup a moment later
            try:
                cap.dir.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
