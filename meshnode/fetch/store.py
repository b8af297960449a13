"""A model being fetched, on disk: resumable, and never holding a byte that was not checked.

``<cache>/fetched/<model id>/`` holds ``manifest.json`` (the canonical bytes the id names),
``model.gguf`` (the file at its full size, a sparse file: the pieces not fetched are holes that take
no disk) and ``pieces.json`` (the offsets of the pieces written and checked, saved as they land). A
piece is checked against the manifest *before* it is written; a fetch killed at any point resumes
from ``pieces.json`` (a piece written but not yet listed is fetched again). Once a range's pieces are
all here, the file is registered under its id (modelid.local.remember), so the slicer cuts the range
from it as from a whole copy.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from meshnode import errors
from meshnode.fetch.plan import Piece
from meshnode.modelid.local import remember
from meshnode.modelid.manifest import Manifest, check_piece, parse
from meshnode.runtime.paths import cache_dir

#: seconds between two saves of the piece list while pieces land
SAVE_EVERY = 1.0


def fetched_dir() -> Path:
    return cache_dir() / "fetched"


class PartialModel:
    """The fetched part of one model (one per model id; one fetcher at a time)."""

    def __init__(self, manifest: Manifest, root: Path | None = None) -> None:
        self.manifest = manifest
        self.model_id = manifest.model_id
        self.dir = (root or fetched_dir()) / self.model_id
        self.path = self.dir / "model.gguf"
        self._pieces = self.dir / "pieces.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        mpath = self.dir / "manifest.json"
        if not mpath.exists():
            tmp = mpath.with_suffix(".tmp")
            tmp.write_bytes(manifest.canonical())
            tmp.replace(mpath)
        if not self.path.exists() or self.path.stat().st_size != manifest.size:
            with self.path.open("ab") as fh:
                fh.truncate(manifest.size)  # holes: no disk is used until a piece lands
        self.have: set[int] = set()
        try:
            listed = json.loads(self._pieces.read_text())
            if isinstance(listed, list):
                self.have = {int(x) for x in listed if isinstance(x, int)}
        except (OSError, ValueError):
            self.have = set()
        self._fd = os.open(self.path, os.O_RDWR)
        self._saved_at = time.monotonic()
        self._dirty = False

    @classmethod
    def open(cls, model_id: str, root: Path | None = None) -> PartialModel | None:
        """The partial model of ``model_id`` kept here, if any (its manifest checked against the id)."""
        d = (root or fetched_dir()) / model_id
        try:
            return cls(parse((d / "manifest.json").read_bytes(), model_id), root)
        except (OSError, errors.ManifestError):
            return None

    def missing(self, pieces: list[Piece]) -> list[Piece]:
        return [p for p in pieces if p.offset not in self.have]

    def write(self, piece: Piece, data: bytes, source: str) -> None:
        """Check ``data`` against the piece's sha256, then write it (IntegrityError naming ``source``
        otherwise: nothing is written)."""
        if len(data) != piece.length:
            raise errors.IntegrityError(f"{source} sent {len(data)} bytes for {piece.what} of {piece.length}")
        check_piece(piece.sha256, data, f"{piece.what} from {source}")
        n = os.pwrite(self._fd, data, piece.offset)
        if n != len(data):
            raise OSError(f"short write of {piece.what} to {self.path}")
        self.have.add(piece.offset)
        self._dirty = True
        if time.monotonic() - self._saved_at >= SAVE_EVERY:
            self.save()

    def forget(self, offsets: set[int]) -> None:
        """Take pieces off the list (a read-back found them changed): they are fetched again."""
        self.have -= offsets
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        os.fsync(self._fd)  # the pieces listed are on disk before the list says so
        tmp = self._pieces.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self.have)))
        tmp.replace(self._pieces)
        self._saved_at, self._dirty = time.monotonic(), False

    def finish(self) -> Path:
        """Save, and register the file under its model id: ``fingerprint(path)`` is then the id without
        reading the holes. Returns the file's path."""
        self.save()
        remember(self.path, self.manifest)
        return self.path

    def close(self) -> None:
        self.save()
        os.close(self._fd)

    def __enter__(self) -> PartialModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def bytes_held(self) -> int:
        from meshnode.fetch.plan import all_pieces

        return sum(p.length for p in all_pieces(self.manifest) if p.offset in self.have)
