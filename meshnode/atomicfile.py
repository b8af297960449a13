"""Files written whole or not at all, with their mode from the start (keys, certificates)."""

from __future__ import annotations

import os
from pathlib import Path


def write(path: Path, data: bytes, mode: int, *, exclusive: bool = False) -> None:
    """``data`` to ``path``: a temporary file beside it (created with ``mode``: a private key is never
    readable by others, not even for a moment), synced, then renamed over ``path``. ``exclusive``: fail
    if the temporary file exists (another writer of this process id)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC), mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
