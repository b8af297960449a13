"""A freshly written range file, put where llama.cpp computes fastest from it: read back from disk.

llama.cpp maps a range's file and streams every weight from that mapping on every decode step, so
how the kernel holds the file's pages is part of a step's time. Pages a writer just filled sit in
the page cache in small folios and are mapped 4 KB at a time; pages the kernel reads back from disk
come in through readahead as large folios (up to 2 MB: ``FileHugePages`` in ``/proc/meminfo``) and
are mapped in far fewer pieces, so a step takes fewer TLB misses. Measured with ``bench.ranges`` on
the 1.34 GB synthetic model, one thread (docs/performance.md, "A second host"): layers 0:12 and
12:24 as just cut took 39.8 and 41.1 ms a step; read back, 34.1 and 38.2 ms, and the two halves
then cost what the whole model costs. (A node maps its range only when memory is tight, or under
``--mmap``; otherwise it reads the weights into its own memory: ``meshnode/executor/weights.py``.)

Pages llama.cpp's own mapping faults in from disk come in large as well (a 535 MB range loaded
from an emptied cache: 473 MB of its 548 MB resident mapped in 2 MB pages, ``FilePmdMapped`` in
``/proc/self/smaps``), so only a file written moments ago is at a loss. A cut file is therefore
flushed to disk, its pages dropped, and the file read back in order, as ``bench.ranges --reread``
does (the cut's hashing pass then reads it from the page cache).
"""

from __future__ import annotations

import os
from pathlib import Path

#: bytes a read back asks for at once
CHUNK = 16 << 20


def settle(path: Path) -> None:
    """Write ``path``'s dirty pages to disk, drop its pages from the page cache and read it back in
    order (best effort: a platform without ``posix_fadvise`` keeps its pages where they are)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):  # nothing to gain here
            return
        while os.read(fd, CHUNK):
            pass
    finally:
        os.close(fd)
