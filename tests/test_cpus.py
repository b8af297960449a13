"""A node's thread defaults count the CPUs it may really use: its affinity mask and its cgroup's
CPU quota (issue 23, item 2: "count the CPUs of the process's affinity mask and cgroup quota, not
the machine's"). The parsers on the texts of cgroup v1 and v2; then a real cgroup with a quota of
one CPU, made by the test (cgroup v1 ``cpu`` or v2 ``cpu.max``) and removed after it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from meshnode.executor.cpus import cgroup_dirs, parse_cfs, parse_cpu_max, quota_cpus

V1 = """9:name=systemd:/
4:memory:/x
2:cpu,cpuacct:/svc/node
0::/
"""
V2 = "0::/system.slice/meshnode.service\n"
MOUNTS = """30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:10 - cgroup cgroup rw,cpu,cpuacct
31 25 0:27 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory
35 25 0:30 / /sys/fs/cgroup/unified rw,relatime shared:14 - cgroup2 cgroup2 rw
"""


def test_parsers() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("garbage") is None
    assert parse_cpu_max("0 100000") is None
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("50000", "100000") == 0.5
    assert parse_cfs("x", "100000") is None
    v1 = cgroup_dirs(V1, MOUNTS)
    assert v1[:3] == [(1, Path("/sys/fs/cgroup/cpu,cpuacct/svc/node")), (1, Path("/sys/fs/cgroup/cpu,cpuacct/svc")),
                      (1, Path("/sys/fs/cgroup/cpu,cpuacct"))]
    assert (2, Path("/sys/fs/cgroup/unified")) in v1
    v2 = cgroup_dirs(V2, MOUNTS)
    assert v2[0] == (2, Path("/sys/fs/cgroup/unified/system.slice/meshnode.service"))
    assert cgroup_dirs("garbage\n", "nonsense") == []


def test_the_smallest_quota_along_the_path_binds() -> None:
    files = {
        Path("/c/a/b/cpu.max"): "max 100000",
        Path("/c/a/cpu.max"): "250000 100000",
        Path("/c/cpu.max"): "300000 100000",
    }
    dirs = [(2, Path("/c/a/b")), (2, Path("/c/a")), (2, Path("/c"))]
    assert quota_cpus(dirs, files.get) == 2.5
    assert quota_cpus([(2, Path("/c/a/b"))], files.get) is None
    v1 = {Path("/v/cpu.cfs_quota_us"): "100000", Path("/v/cpu.cfs_period_us"): "100000"}
    assert quota_cpus([(1, Path("/v"))], v1.get) == 1.0


def _cgroup_with_one_cpu() -> tuple[Path, Path]:
    """(the cgroup made, the file a pid is written to), or skip when this machine gives no writable one."""
    v1 = Path("/sys/fs/cgroup/cpu")
    name = f"meshnode-test-{uuid.uuid4().hex[:8]}"
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        d = v1 / name
        d.mkdir()
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("100000")
        return d, d / "cgroup.procs"
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        ctl = root / "cgroup.subtree_control"
        if ctl.exists() and "cpu" in ctl.read_text().split() and os.access(root, os.W_OK):
            d = root / name
            d.mkdir()
            (d / "cpu.max").write_text("100000 100000")
            return d, d / "cgroup.procs"
    pytest.skip("no writable cgroup with a CPU controller on this machine (cgroup v1 cpu or v2 cpu.max)")


def test_a_quota_of_one_cpu_gives_one_thread() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("this machine has one CPU: a quota of one cannot narrow it")
    probe = ("from meshnode.executor.config import ExecConfig as C; c = C(); "
             "print(c.n_threads_batch, c.n_threads_solo, c.n_threads)")
    outside = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert outside.stdout.split()[0] == str(len(os.sched_getaffinity(0)))
    d, procs = _cgroup_with_one_cpu()
    try:
        inside = subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$0" -c "$1"', sys.executable, probe],
                                capture_output=True, text=True, check=True)
        assert inside.stdout.split() == ["1", "1", "1"], inside.stderr
    finally:
        d.rmdir()
