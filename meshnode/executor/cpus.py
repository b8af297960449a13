"""How many CPUs this process may really use: its affinity mask, and its cgroup's CPU quota.

A container or a systemd unit (``CPUQuota=``) can give a process less CPU time than the CPUs its
affinity mask shows: 2 CPUs visible, 1 CPU of quota. Threads beyond the quota only take turns at
the throttle, and an OpenMP team whose threads are throttled waits at every barrier. So the node's
thread defaults count ``ceil(quota / period)`` when it is smaller (cgroup v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; the smallest along the cgroup's path, since a parent's
limit binds its children).

``quota_cpus`` and ``cgroup_dirs`` are pure (text in, answer out); ``usable_cpus`` reads /proc and
/sys once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") -> CPUs, None when unlimited or unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs(quota: str, period: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: unlimited) and ``cpu.cfs_period_us`` -> CPUs, or None."""
    try:
        q, p = int(quota.strip()), int(period.strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_dirs(proc_cgroup: str, mountinfo: str, controller: str = "cpu") -> list[tuple[int, Path]]:
    """The CPU-controller directories of this process's cgroup and of its ancestors, deepest first,
    each with its version (1 or 2), from /proc/self/cgroup and /proc/self/mountinfo."""
    mounts: dict[str, Path] = {}  # the v1 controller's name, or "" (v2) -> mount point
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or not rest:
            continue
        if rest[0] == "cgroup2":
            mounts.setdefault("", Path(fields[4]))
        elif rest[0] == "cgroup" and len(rest) >= 3 and controller in rest[2].split(","):
            mounts.setdefault(controller, Path(fields[4]))
    out: list[tuple[int, Path]] = []
    for entry in proc_cgroup.splitlines():
        hid, _, tail = entry.partition(":")
        controllers, _, path = tail.partition(":")
        if hid == "0" and controllers == "" and "" in mounts:
            version, root = 2, mounts[""]
        elif controller in controllers.split(",") and controller in mounts:
            version, root = 1, mounts[controller]
        else:
            continue
        rel = Path(path.lstrip("/"))
        for d in [rel, *rel.parents]:
            out.append((version, root / d))
    return out


def quota_cpus(dirs: list[tuple[int, Path]], read: Callable[[Path], str | None]) -> float | None:
    """The smallest CPU quota along ``dirs`` (None: no quota anywhere)."""
    limits = []
    for version, d in dirs:
        if version == 2:
            text = read(d / "cpu.max")
            limit = parse_cpu_max(text) if text is not None else None
        else:
            q, p = read(d / "cpu.cfs_quota_us"), read(d / "cpu.cfs_period_us")
            limit = parse_cfs(q, p) if q is not None and p is not None else None
        if limit is not None:
            limits.append(limit)
    return min(limits) if limits else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def usable_cpus() -> int:
    """The CPUs of the affinity mask, or fewer when the cgroup's CPU quota allows fewer (rounded up)."""
    mask = len(os.sched_getaffinity(0)) or 1
    cgroup, mountinfo = _read(Path("/proc/self/cgroup")), _read(Path("/proc/self/mountinfo"))
    if cgroup is None or mountinfo is None:
        return mask
    quota = quota_cpus(cgroup_dirs(cgroup, mountinfo), _read)
    return mask if quota is None else max(1, min(mask, math.ceil(quota - 1e-9)))


def memory_limit(dirs: list[tuple[int, Path]], read: Callable[[Path], str | None]) -> tuple[int, int] | None:
    """(limit, usage) in bytes of the tightest memory limit along ``dirs`` (v2 ``memory.max`` /
    ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``), or None."""
    best: tuple[int, int] | None = None
    for version, d in dirs:
        names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes",
                                                                        "memory.usage_in_bytes")
        limit, usage = read(d / names[0]), read(d / names[1])
        if limit is None or not limit.strip().isdigit():
            continue  # "max", unreadable
        n = int(limit.strip())
        if n >= 1 << 60:  # v1's "no limit" is a huge number
            continue
        used = int(usage.strip()) if usage is not None and usage.strip().isdigit() else 0
        if best is None or n - used < best[0] - best[1]:
            best = (n, used)
    return best


def available_memory() -> int:
    """Bytes this process may still use: MemAvailable, or less when its cgroup's memory limit leaves less."""
    from meshnode.routing.sizing import available_memory as pure

    meminfo = _read(Path("/proc/meminfo")) or ""
    cgroup, mountinfo = _read(Path("/proc/self/cgroup")), _read(Path("/proc/self/mountinfo"))
    lim = memory_limit(cgroup_dirs(cgroup, mountinfo, "memory"), _read) if cgroup and mountinfo else None
    return pure(meminfo, lim[0] if lim else None, lim[1] if lim else 0)
