"""The manifest and model id of a GGUF on this machine, computed once per file version and kept.

Computing a manifest reads the whole file once (the header, then every tensor: its sha256 and its
pieces' in the same pass), as hashing the file would. The result is kept in the cache directory:
``manifests/<id>.json`` (its canonical bytes, which a node serves to peers that fetch the model) and
``model-ids.json`` (path, size and mtime -> id), so a file is read again only when it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from meshnode.errors import ManifestError
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import check_file
from meshnode.modelid.manifest import PIECE_BYTES, Manifest, Tensor, parse
from meshnode.runtime.paths import cache_dir


def manifests_dir() -> Path:
    return cache_dir() / "manifests"


def compute(path: Path, piece_bytes: int = PIECE_BYTES) -> Manifest:
    """Read ``path`` and build its manifest (typed errors for a file that is not a usable GGUF)."""
    check_file(path)
    meta = read_meta(path)
    size = path.stat().st_size
    tensors = []
    buf = memoryview(bytearray(1 << 20))
    total = sum(t.n_bytes for t in meta.tensors)
    with path.open("rb", buffering=0) as fh, tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr,
                                                  desc=f"model id of {path.name}", disable=None) as progress:
        header = fh.read(meta.data_offset)
        for t in sorted(meta.tensors, key=lambda t: t.offset):
            whole = hashlib.sha256()
            pieces: list[str] = []
            fh.seek(t.offset)
            left = t.n_bytes
            while left or not pieces:
                piece = hashlib.sha256()
                want = min(piece_bytes, left)
                while want:
                    got = fh.readinto(buf[: min(want, len(buf))])
                    if not got:
                        raise ManifestError(f"{path} ended inside tensor {t.name}")
                    piece.update(buf[:got])
                    whole.update(buf[:got])
                    want -= got
                    left -= got
                    progress.update(got)
                pieces.append(piece.hexdigest())
                if not left:
                    break
            tensors.append(Tensor(t.name, int(t.type), tuple(int(d) for d in t.shape), t.offset, t.n_bytes,
                                  whole.hexdigest(), tuple(pieces) if len(pieces) > 1 else ()))
    return Manifest(meta.data_offset, hashlib.sha256(header).hexdigest(), size, piece_bytes, tuple(tensors))


def _index() -> Path:
    return cache_dir() / "model-ids.json"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def model_id(path: Path) -> str:
    """The model id of the file at ``path`` (computed on first use, then remembered)."""
    return manifest_of(path).model_id


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _table() -> dict[str, str]:
    try:
        table = json.loads(_index().read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def remember(path: Path, m: Manifest) -> None:
    """Record that the file at ``path`` (as it is now) is the model ``m`` names: a fetched file whose
    pieces were each checked against ``m`` (fetch/store.py), whose holes must not be hashed."""
    table = _table()
    table[_key(path)] = store(m)
    _write_atomic(_index(), json.dumps(table, indent=1, sort_keys=True).encode())


def manifest_of(path: Path) -> Manifest:
    """The file's manifest: from the cache while the file is unchanged, else computed and kept."""
    key = _key(path)
    table = _table()
    known = table.get(key)
    if isinstance(known, str):
        m = stored(known)
        if m is not None:
            return m
    m = compute(path)
    mid = store(m)
    table[key] = mid
    _write_atomic(_index(), json.dumps(table, indent=1, sort_keys=True).encode())
    return m


def store(m: Manifest) -> str:
    """Keep a manifest (its canonical bytes) under its id; returns the id."""
    mid = m.model_id
    _write_atomic(manifests_dir() / f"{mid}.json", m.canonical())
    return mid


def stored(mid: str) -> Manifest | None:
    """The kept manifest of ``mid`` (checked against it), or None."""
    try:
        raw = (manifests_dir() / f"{mid}.json").read_bytes()
    except OSError:
        return None
    try:
        return parse(raw, mid)
    except ManifestError:
        return None
