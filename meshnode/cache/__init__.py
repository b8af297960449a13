"""The model cache: what it holds (``inventory``), what running nodes use (``inuse``), and what a cache
limit removes (``evict``: pure). ``meshnode model ls`` / ``rm`` / ``gc``; nodes take ``--cache-limit``."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from meshnode import errors
from meshnode.cache.evict import Entry, choose
from meshnode.cache.inventory import remove, scan
from meshnode.runtime.paths import cache_dir

__all__ = ["Entry", "check_room", "enforce", "remove", "scan"]

log = logging.getLogger("meshnode.cache")

#: disk a cut or a fetch leaves free beyond what it writes
RESERVE = 512 << 20


def enforce(limit: int, root: Path | None = None) -> list[Entry]:
    """Remove what the limit (bytes of ranges and fetched models) says, never what a node serves."""
    gone = choose(scan(root), limit)
    for e in gone:
        remove(e)
        log.info("cache limit: removed %s %s (%s %s, %d MB, unused)", e.kind, e.path, e.name, e.layers, e.bytes >> 20)
    return gone


def check_room(need: int, what: str, root: Path | None = None) -> None:
    """InputError unless the cache's disk has ``need`` bytes free beyond a reserve."""
    d = root or cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(d).free
    if free < need + RESERVE:
        raise errors.InputError(f"{what} needs {need >> 20} MB but {d} has {free >> 20} MB free (keeping "
                                f"{RESERVE >> 20} MB): make room (`meshnode model ls`, `meshnode model rm`, "
                                f"`meshnode model gc --limit GB`)")
