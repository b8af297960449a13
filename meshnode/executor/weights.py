"""Where a range's weights live: read into the node's memory, or mapped from the file.

A decode step streams every weight of the range, and how fast it can depends on how the kernel holds
the pages it reads. A mapped file keeps whatever page-cache state it had (small folios after a write,
large ones after readahead, reshuffled by reclaim and by other readers), and that state lasts: on this
project's machine kind the same 1.34 GB file decoded 1.35x slower from one state than from another, for
hours, until its pages were dropped. Weights read into the process's own memory decoded at the best
mapped speed in every state measured (docs/performance.md, "Weights mapped or read").

Reading costs what the weights weigh in the node's own memory, where a mapping's pages are page cache
the kernel can take back under pressure. So a node reads its weights while they take at most
1/``READ_SHARE`` of the memory available at start-up (its cgroup's limit counted), and maps them when
memory is tighter than that: a node squeezed into a small cgroup keeps serving from the page cache,
slower, instead of being killed by its limit. ``--mmap`` / ``--no-mmap`` decide it by hand.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from meshnode.executor.config import ExecConfig

#: weights are read into memory while they take at most 1/READ_SHARE of the memory available at start-up
#: (the KV cache may take another quarter: executor/context.py)
READ_SHARE = 2

log = logging.getLogger("meshnode.node")


def reads_weights(file_bytes: int, mem_available: int) -> bool:
    """Whether a range file of ``file_bytes`` is read into memory rather than mapped. Pure.

    ``mem_available`` 0 means unknown: read (the file is there to be served, and a machine that does not
    say what it has is not a small cgroup)."""
    if mem_available <= 0:
        return True
    return file_bytes * READ_SHARE <= mem_available


def resolve_mmap(config: ExecConfig, range_path: Path, mem_available: int) -> ExecConfig:
    """``config`` with ``use_mmap`` decided: as given, or by ``reads_weights`` for this file."""
    if config.use_mmap is not None:
        return config
    size = range_path.stat().st_size
    read = reads_weights(size, mem_available)
    if not read:
        log.info("mapping %s (%.0f MB) instead of reading it: %.0f MB of memory available", range_path.name,
                 size / 1e6, mem_available / 1e6)
    return dataclasses.replace(config, use_mmap=not read)
