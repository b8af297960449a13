"""Fetching a model's bytes from the peers that hold it, every piece checked before it is written.

``fetch_manifest`` asks peers in turn for the manifest of a model id and keeps the first whose bytes
hash to the id. ``fetch_pieces`` then fetches the missing pieces from several peers at once (two
streams per peer, a few pieces per request), each piece checked against the manifest before it is
written (fetch/store.py). A peer that sends a wrong byte is dropped and named, and its pieces go to
the others; a busy peer (``FETCH_BUSY``) is asked again after a pause; a piece no live peer holds
ends the fetch with the pieces that are missing named. Progress: a bar on a terminal, and a log line
at every tenth.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from meshnode import errors
from meshnode.fetch.plan import Piece
from meshnode.fetch.store import PartialModel
from meshnode.modelid.manifest import MAX_MANIFEST_BYTES, Manifest, parse
from meshnode.proto import node_pb2 as pb
from meshnode.transport import client

log = logging.getLogger("meshnode.fetch")

#: streams open to one peer at once (a peer allows 2 per requester by default: fetch/limits.py)
STREAMS_PER_PEER = 2
#: pieces asked for in one request (4 MiB each)
BATCH = 4
#: a busy or failing peer is asked again this many times, after a pause that doubles from this
RETRIES, PAUSE = 5, 0.25


@dataclass
class FetchReport:
    pieces: int = 0
    bytes: int = 0
    #: bytes by the peer that sent them
    by_peer: dict[str, int] = field(default_factory=dict)
    #: peers dropped, and why (a wrong byte, or unreachable)
    dropped: dict[str, str] = field(default_factory=dict)


async def fetch_manifest(peers: list[str], model_id: str) -> Manifest:
    """The manifest of ``model_id`` from the first peer that has it (checked against the id)."""
    why: list[str] = []
    for peer in peers:
        try:
            parts: dict[int, bytes] = {}
            size = 0
            async for chunk in client.fetch(peer, pb.FetchRequest(model_id=model_id, manifest=True), timeout=60):
                if chunk.total > MAX_MANIFEST_BYTES or chunk.offset + len(chunk.data) > chunk.total:
                    raise errors.ManifestError(f"{peer} sends a manifest of {chunk.total} bytes")
                parts[chunk.offset] = chunk.data
                size = chunk.total
            raw = b"".join(parts[k] for k in sorted(parts))
            if len(raw) != size:
                raise errors.ManifestError(f"{peer} sent {len(raw)} of the manifest's {size} bytes")
            return parse(raw, model_id)
        except errors.MeshnodeError as e:
            why.append(f"{peer}: {e}")
    raise errors.PeerError(f"no peer gave the manifest of model {model_id[:16]}…: " + "; ".join(why or ["no peers"]))


async def fetch_pieces(part: PartialModel, pieces: list[Piece], peers: list[str], *,
                       desc: str = "fetching") -> FetchReport:
    """Fetch the pieces ``part`` lacks of ``pieces`` from ``peers``; returns what came from whom."""
    todo = collections.deque(part.missing(pieces))
    report = FetchReport()
    if not todo:
        return report
    total = sum(p.length for p in todo)
    lacking: dict[str, set[int]] = collections.defaultdict(set)  # peer -> offsets it said it does not hold
    live = set(peers)
    single: set[str] = set()  # peers that hold only some pieces: asked one piece at a time
    tenth = [0]

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=None)

    def landed(peer: str, piece: Piece) -> None:
        report.pieces += 1
        report.bytes += piece.length
        report.by_peer[peer] = report.by_peer.get(peer, 0) + piece.length
        bar.update(piece.length)
        if report.bytes * 10 // total > tenth[0]:
            tenth[0] = report.bytes * 10 // total
            log.info("%s: %d%% (%d of %d MB)", desc, tenth[0] * 10, report.bytes >> 20, total >> 20)

    def take(peer: str) -> list[Piece]:
        batch: list[Piece] = []
        for _ in range(len(todo)):
            if len(batch) >= (1 if peer in single else BATCH):
                break
            p = todo.popleft()
            if p.offset in lacking[peer]:
                todo.append(p)
            else:
                batch.append(p)
        return batch

    async def worker(peer: str) -> None:
        failures = 0
        while peer in live and todo:
            batch = take(peer)
            if not batch:
                return  # what is left, this peer does not hold
            pending = {p.offset: p for p in batch}
            buf: dict[int, bytearray] = {}
            try:
                req = pb.FetchRequest(model_id=part.model_id,
                                      spans=[pb.ByteSpan(offset=p.offset, length=p.length) for p in batch])
                async for chunk in client.fetch(peer, req):
                    piece = next((p for p in pending.values()
                                  if p.offset <= chunk.offset < p.offset + p.length), None)
                    if piece is None:
                        raise errors.IntegrityError(f"{peer} sent bytes at {chunk.offset}, which were not asked for")
                    got = buf.setdefault(piece.offset, bytearray())
                    if chunk.offset != piece.offset + len(got) or len(got) + len(chunk.data) > piece.length:
                        raise errors.IntegrityError(f"{peer} sent {piece.what} out of order or too long")
                    got += chunk.data
                    if len(got) == piece.length:
                        part.write(piece, bytes(got), peer)  # checked before it is written
                        del pending[piece.offset], buf[piece.offset]
                        landed(peer, piece)
                if pending:
                    raise errors.PeerError(f"{peer} ended the fetch with {len(pending)} pieces unsent", hop=peer)
                failures = 0
            except errors.IntegrityError as e:
                live.discard(peer)
                report.dropped[peer] = str(e)
                log.warning("dropped %s: it sent bytes that are not the model's (%s)", peer, e)
            except errors.ModelNotFoundError:
                if len(batch) == 1:
                    lacking[peer].update(pending)  # it does not hold this piece: others will send it
                single.add(peer)  # not all of a batch: ask it piece by piece from now on
            except errors.MeshnodeError as e:
                failures += 1
                if failures > RETRIES:
                    live.discard(peer)
                    report.dropped[peer] = str(e)
                    log.warning("dropped %s after %d failed fetches: %s", peer, failures, e)
                else:
                    await asyncio.sleep(PAUSE * 2 ** (failures - 1))
            finally:
                todo.extend(pending.values())  # not landed: for anyone

    try:
        while todo:
            if not live:
                break
            await asyncio.gather(*(worker(p) for p in sorted(live) for _ in range(STREAMS_PER_PEER)))
            if todo and all(p.offset in lacking[q] for p in todo for q in live):
                break  # what is left, no live peer holds
    finally:
        bar.close()
        part.save()
    if todo:
        names = sorted({p.what.rsplit(" piece", 1)[0] for p in todo})
        raise errors.PeerError(f"{len(todo)} pieces of model {part.model_id[:16]}… could not be fetched "
                               f"({', '.join(names[:5])}{'…' if len(names) > 5 else ''}); peers dropped: "
                               f"{report.dropped or 'none'}")
    return report
