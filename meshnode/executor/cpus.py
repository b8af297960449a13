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


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path]]:
    """The CPU-controller directories of this process's cgroup and of its ancestors, deepest first,
    each with its version (1 or 2), from /proc/self/cgroup and /proc/self/mountinfo."""
    mounts: dict[str, Path] = {}  # "cpu" (v1 controller) or "" (v2) -> mount point
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or not rest:
            continue
        if rest[0] == "cgroup2":
            mounts.setdefault("", Path(fields[4]))
        elif rest[0] == "cgroup" and len(rest) >= 3 and "cpu" in rest[2].split(","):
            mounts.setdefault("cpu", Path(fields[4]))
    out: list[tuple[int, Path]] = []
    for entry in proc_cgroup.splitlines():
        hid, _, tail = entry.partition(":")
        controllers, _, path = tail.partition(":")
        if hid == "0" and controllers == "" and "" in mounts:
            version, root = 2, mounts[""]
        elif "cpu" in controllers.split(",") and "cpu" in mounts:
            version, root = 1, mounts["cpu"]
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
