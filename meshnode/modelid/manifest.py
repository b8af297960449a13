"""A model's manifest and its id: enough to check any piece of the model's bytes on its own.

The manifest of a GGUF lists the sha256 of its header (everything before the tensor data: the
key/values, the tensor infos, the padding) and, for every tensor in file order, its name, ggml type,
shape, offset, length and sha256, plus the sha256 of each ``piece_bytes`` piece of a tensor longer than
one piece (BitTorrent's pieces: a chunk fetched from a peer is checked before it is written, without
the rest of the tensor). Its canonical JSON (sorted keys, no spaces, ASCII) hashed with sha256 is the
**model id**: anyone holding the file computes the same id, and anyone holding the manifest of an id
checks a peer's header, tensor or piece against it, with no other copy of the file.

Everything here is pure (bytes and dicts in, answers out); ``modelid.local`` computes a file's
manifest. A manifest received from a peer is hostile until ``parse`` has checked it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from meshnode.errors import IntegrityError, ManifestError

FORMAT = "meshnode-model/1"
#: the piece a fetch checks at once (and the unit of a resumed fetch): 4 MiB
PIECE_BYTES = 1 << 22
#: a manifest larger than this is refused unread (a 400 GB model of 4 MiB pieces lists ~100k pieces,
#: ~7 MB of JSON)
MAX_MANIFEST_BYTES = 64 << 20
#: the most tensors a manifest may list (the largest GGUFs hold a few thousand)
MAX_TENSORS = 1 << 16
_HEX64 = re.compile(r"[0-9a-f]{64}")
_ID_PREFIX = re.compile(r"[0-9a-f]{8,64}")


@dataclass(frozen=True)
class Tensor:
    name: str
    type: int
    shape: tuple[int, ...]
    #: absolute offset of its bytes in the file
    offset: int
    n_bytes: int
    sha256: str
    #: sha256 of each piece (empty when the tensor is one piece: its sha256 covers it)
    pieces: tuple[str, ...] = ()

    def piece_spans(self, piece_bytes: int) -> Iterator[tuple[int, int, str]]:
        """(offset in the file, length, sha256) of each piece in order."""
        if not self.pieces:
            yield self.offset, self.n_bytes, self.sha256
            return
        for i, digest in enumerate(self.pieces):
            start = i * piece_bytes
            yield self.offset + start, min(piece_bytes, self.n_bytes - start), digest


@dataclass(frozen=True)
class Manifest:
    header_bytes: int
    header_sha256: str
    size: int
    piece_bytes: int
    tensors: tuple[Tensor, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "header": {"n_bytes": self.header_bytes, "sha256": self.header_sha256},
            "size": self.size,
            "piece_bytes": self.piece_bytes,
            "tensors": [
                {"name": t.name, "type": t.type, "shape": list(t.shape), "offset": t.offset, "n_bytes": t.n_bytes,
                 "sha256": t.sha256, **({"pieces": list(t.pieces)} if t.pieces else {})}
                for t in self.tensors
            ],
        }

    def canonical(self) -> bytes:
        return canonical(self.to_dict())

    @property
    def model_id(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise ManifestError(f"the model has no tensor {name!r}")

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def pieces_needed(n_bytes: int, piece_bytes: int) -> int:
    return max(-(-n_bytes // piece_bytes), 1)


def check_piece(expected_sha256: str, data: bytes | memoryview, what: str) -> None:
    """IntegrityError unless ``data`` hashes to ``expected_sha256``."""
    got = hashlib.sha256(data).hexdigest()
    if got != expected_sha256:
        raise IntegrityError(f"{what}: sha256 {got[:16]}… is not the manifest's {expected_sha256[:16]}…")


def is_id_prefix(text: str) -> bool:
    """Whether ``text`` can name a model by its id (8 to 64 lower-case hex digits)."""
    return bool(_ID_PREFIX.fullmatch(text))


def parse(raw: bytes, model_id: str | None = None) -> Manifest:
    """A manifest from its JSON bytes, every field and every invariant checked; with ``model_id``, also
    that these bytes hash to it (so nothing in it can be other than what the id names).

    ManifestError for anything else: wrong types, overlapping or out-of-file tensors, a piece list that
    does not tile its tensor, duplicate names, oversized input.
    """
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"a manifest of {len(raw)} bytes is over the limit of {MAX_MANIFEST_BYTES}")
    if model_id is not None and hashlib.sha256(raw).hexdigest() != model_id:
        raise ManifestError(f"the manifest's bytes do not hash to the model id {model_id[:16]}…")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"a manifest is not JSON: {e}") from None
    m = from_dict(doc)
    if model_id is not None and m.canonical() != raw:
        raise ManifestError("the manifest is not in canonical form")
    return m


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"manifest: {what} must be a whole number in [{lo}, {hi}], not {v!r}")
    return v


def _hex(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _HEX64.fullmatch(v):
        raise ManifestError(f"manifest: {what} must be 64 lower-case hex digits")
    return v


def from_dict(doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"not a {FORMAT} manifest")
    header = doc.get("header")
    if not isinstance(header, dict):
        raise ManifestError("manifest: no header")
    size = _int(doc.get("size"), "size")
    piece = _int(doc.get("piece_bytes"), "piece_bytes", 1 << 16, 1 << 26)
    if piece & (piece - 1):
        raise ManifestError(f"manifest: piece_bytes {piece} is not a power of two")
    header_bytes = _int(header.get("n_bytes"), "header.n_bytes", 24, size)
    tensors_raw = doc.get("tensors")
    if not isinstance(tensors_raw, list) or len(tensors_raw) > MAX_TENSORS:
        raise ManifestError(f"manifest: tensors must be a list of at most {MAX_TENSORS}")
    tensors: list[Tensor] = []
    names: set[str] = set()
    end = header_bytes
    for i, t in enumerate(tensors_raw):
        if not isinstance(t, dict):
            raise ManifestError(f"manifest: tensor {i} is not an object")
        name = t.get("name")
        if not isinstance(name, str) or not name or len(name) > 256 or name in names:
            raise ManifestError(f"manifest: tensor {i} has a missing, overlong or repeated name")
        names.add(name)
        shape = t.get("shape")
        if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
            raise ManifestError(f"manifest: tensor {name} has no shape of 1 to 4 dimensions")
        offset = _int(t.get("offset"), f"{name}.offset", end, size)
        n = _int(t.get("n_bytes"), f"{name}.n_bytes", 0, size - offset)
        pieces = t.get("pieces", [])
        if not isinstance(pieces, list):
            raise ManifestError(f"manifest: {name}.pieces must be a list")
        want = pieces_needed(n, piece)
        if (want > 1 or pieces) and len(pieces) != want:
            raise ManifestError(f"manifest: {name} of {n} bytes needs {want} pieces of {piece}, lists {len(pieces)}")
        tensors.append(Tensor(name, _int(t.get("type"), f"{name}.type", 0, 1 << 16),
                              tuple(_int(d, f"{name}.shape", 0) for d in shape), offset, n,
                              _hex(t.get("sha256"), f"{name}.sha256"),
                              tuple(_hex(p, f"{name}.pieces") for p in pieces)))
        end = offset + n
    return Manifest(header_bytes, _hex(header.get("sha256"), "header.sha256"), size, piece, tuple(tensors))
