"""Weights and KV cache in transparent huge pages.

A decode step streams every weight of the range. Read into the node's memory (``weights.py``), they sit
in anonymous pages, and on a kernel whose transparent huge pages are ``madvise`` (Ubuntu's default and
this project's machine kind's) those are 4 KB pages unless the process asks: a 1.34 GB model is then
~330,000 pages whose translations every decode step walks. llama.cpp does not ask (its CPU buffer is a
plain ``posix_memalign``), and ``MADV_COLLAPSE`` after the fact is not in every kernel (not in this
project's machine kind's), so the ask goes to glibc: its tunable ``glibc.malloc.hugetlb=1`` (glibc 2.35+)
makes malloc ``madvise(MADV_HUGEPAGE)`` every chunk it maps *before* the first write, and the weights,
the KV cache and the compute buffers fault in as 2 MB pages. glibc reads tunables once, when the process
starts, so ``meshnode serve`` / ``join`` re-executes itself with the tunable set (same PID, same
arguments; the systemd unit sets it already and needs no second start). The whole 1.34 GB model in
``Llama`` decoded ~10% faster so (docs/performance.md, "Weights in huge pages"). Numerics are unchanged:
only where the bytes sit moves.

``--no-huge-pages`` (``huge_pages = false``) leaves the process as started.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("meshnode.node")

TUNABLE = "glibc.malloc.hugetlb"
#: glibc's first release with ``glibc.malloc.hugetlb``
GLIBC_WITH_TUNABLE = (2, 35)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(text: str) -> str:
    """The bracketed choice of ``/sys/kernel/mm/transparent_hugepage/enabled`` ("" if none). Pure."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


def wants_tunable(env: Mapping[str, str], thp: str, libc: tuple[str, str]) -> bool:
    """Whether a process started with ``env`` should start again with the tunable. Pure.

    Only where it changes something: THP ``madvise`` (``always`` gives malloc's big chunks huge pages
    anyway, ``never`` gives none), glibc 2.35 or later, and the tunable not given (a user's own value,
    ``=0`` included, wins)."""
    name, version = libc
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    given = any(t.split("=", 1)[0] == TUNABLE for t in env.get("GLIBC_TUNABLES", "").split(":"))
    return thp == "madvise" and name == "glibc" and have >= GLIBC_WITH_TUNABLE and not given


def with_tunable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``glibc.malloc.hugetlb=1`` added to its ``GLIBC_TUNABLES``. Pure."""
    out = dict(env)
    tunables = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
    out["GLIBC_TUNABLES"] = ":".join([*tunables, f"{TUNABLE}=1"])
    return out


def env_here(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with the tunable, if starting with it changes something on this machine; else None."""
    try:
        thp = thp_mode(THP_ENABLED.read_text())
    except OSError:
        return None
    return with_tunable(env) if wants_tunable(env, thp, platform.libc_ver()) else None


def reexec_with_huge_pages() -> None:
    """Start this process again (``execve``: same PID) with the tunable, if it changes anything here.

    Call it before anything worth keeping exists: threads, sockets, loaded models are all gone after."""
    env = env_here(os.environ)
    if env is None:
        return
    log.debug("starting again with %s=1 (transparent huge pages for the weights)", TUNABLE)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def huge_bytes(smaps_rollup: str) -> int:
    """``AnonHugePages`` of a ``/proc/PID/smaps_rollup`` text, in bytes (0 if absent). Pure."""
    for line in smaps_rollup.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
