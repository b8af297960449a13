"""What a node needs of a model to serve a range, and which peer sends which piece (pure).

A range's artifact (gguf/slicer.py) reads of the source file its header (the metadata) and the
tensors ``slicer.source_reads`` names: the blocks of its layers, the global tensors, and of the two
vocabulary-sized matrices what its role uses. A node that joins without a copy fetches those and
nothing else (tests/test_fetch.py cuts the same artifact from the fetched file as from the whole one).

The unit of transfer and of checking is the manifest's piece (modelid/manifest.py): the header, or a
``piece_bytes`` piece of a tensor. ``assign`` deals the missing pieces among the peers that hold
them, round robin over each piece's holders, so several peers send at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from meshnode.modelid.manifest import Manifest


@dataclass(frozen=True, order=True)
class Piece:
    """One checked unit: ``length`` bytes at ``offset`` of the file, whose sha256 the manifest lists."""

    offset: int
    length: int
    sha256: str
    #: what it is, for messages: "header" or "TENSOR piece I"
    what: str


def pieces(manifest: Manifest, tensors: Iterable[str]) -> list[Piece]:
    """The header and every piece of ``tensors``, in file order."""
    out = [Piece(0, manifest.header_bytes, manifest.header_sha256, "header")]
    want = set(tensors)
    for t in manifest.tensors:
        if t.name in want:
            for i, (off, n, digest) in enumerate(t.piece_spans(manifest.piece_bytes)):
                out.append(Piece(off, n, digest, f"{t.name} piece {i}"))
    return sorted(out)


def all_pieces(manifest: Manifest) -> list[Piece]:
    return pieces(manifest, (t.name for t in manifest.tensors))


def assign(missing: Sequence[Piece], holders: dict[str, Sequence[Piece] | None]) -> dict[str, list[Piece]]:
    """Deal ``missing`` among peers: each piece to the next of its holders in turn (a holder whose list
    is None holds every piece). Pieces nobody holds are left out (the caller names them)."""
    peers = sorted(holders)
    held = {p: None if holders[p] is None else {x.offset for x in holders[p] or ()} for p in peers}
    out: dict[str, list[Piece]] = {p: [] for p in peers}
    turn = 0
    for piece in missing:
        can = [p for p in peers if held[p] is None or piece.offset in held[p]]  # type: ignore[operator]
        if not can:
            continue
        out[can[turn % len(can)]].append(piece)
        turn += 1
    return {p: v for p, v in out.items() if v}


def piece_at(pieces_: Iterable[Piece], offset: int, length: int) -> Piece | None:
    """The piece that is exactly the span (offset, length), if any."""
    for p in pieces_:
        if p.offset == offset and p.length == length:
            return p
    return None
