"""Where meshnode keeps its files. Read once at the edge, never at import time."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MESHNODE_CACHE_DIR, else $CACHE_DIRECTORY (systemd), else $XDG_CACHE_HOME/meshnode, else ~/.cache/meshnode."""
    explicit = os.environ.get("MESHNODE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "meshnode"


def state_dir() -> Path:
    """$STATE_DIRECTORY (systemd), else $XDG_STATE_HOME/meshnode, else ~/.local/state/meshnode."""
    systemd = os.environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "meshnode"
