"""Where meshnode keeps its files. Read once at the edge, never at import time."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MESHNODE_CACHE_DIR, else $XDG_CACHE_HOME/meshnode, else ~/.cache/meshnode."""
    explicit = os.environ.get("MESHNODE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "meshnode"
