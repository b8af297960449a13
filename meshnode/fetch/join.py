"""Joining a mesh with no copy of the model: find who holds it, fetch this node's share, check it.

``serve`` / ``join --mesh NAME`` with no ``--model``: the peers serving the model NAME names are
found through the tracker and/or mDNS (as ``generate --mesh`` finds them); the range is the one
given, or with ``--auto`` the weakest-covered one; the manifest comes from a peer and must hash to
the model id the directory lists; then the header, and the pieces of the tensors the range's cut
reads (``slicer.source_reads``), from several peers at once, each checked before it is written
(fetch/client.py), resumable after a kill (fetch/store.py). Before the file is handed to the slicer
every tensor the cut reads is checked again whole against the manifest: nothing unchecked is loaded.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from meshnode import errors
from meshnode.cache import check_room
from meshnode.discovery.mdns import PeerTable, run_mdns
from meshnode.discovery.table import PeerEntry, Seen
from meshnode.discovery.tracker_client import lookup_any
from meshnode.fetch.client import FetchReport, fetch_manifest, fetch_pieces
from meshnode.fetch.plan import Piece, pieces
from meshnode.fetch.store import PartialModel, fetched_dir
from meshnode.gguf.meta import read_meta
from meshnode.gguf.slicer import source_reads
from meshnode.modelid.local import stored
from meshnode.modelid.manifest import Manifest
from meshnode.routing.assign import is_short_prefix, model_matches
from meshnode.transport.aiothread import open_aio_thread

log = logging.getLogger("meshnode.fetch")


@dataclass(frozen=True)
class Holders:
    model_id: str
    n_layer: int
    name: str
    peers: list[PeerEntry]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(p.capability.range.start, p.capability.range.end) for p in self.peers]

    @property
    def step_times(self) -> list[tuple[int, int, float]]:
        """Each peer's (start, end, seconds a decode step of its range takes it), from what it advertises."""
        out = []
        for p in self.peers:
            tps, r = p.capability.throughput.decode_tokens_per_second, p.capability.range
            if tps > 0 and r.end > r.start:
                out.append((r.start, r.end, 1.0 / tps))
        return out


async def find_holders(query: str, *, tracker: str | Sequence[str] | None, mdns: str | None, timeout: float = 5.0,
                       required: bool = True) -> Holders:
    """The live peers serving the one model ``query`` names (RouteError if several models, or if none
    and ``required``; else an empty ``Holders``)."""
    if not tracker and not mdns:
        raise errors.InputError("--mesh without --model needs to see the mesh: give --tracker URL and/or --mdns ADDR")
    if is_short_prefix(query):
        raise errors.InputError(f"--mesh {query!r}: a model id prefix needs 8+ hex digits")
    table = PeerTable()

    def mine() -> list[PeerEntry]:
        return [p for p in table.live().values() if model_matches(p.capability.model_fingerprint,
                                                                  p.capability.model_name, query,
                                                                  p.capability.model_file)]

    async with open_aio_thread() as aio, trio.open_nursery() as nursery:
        if mdns:
            await nursery.start(functools.partial(run_mdns, table, interface=mdns, aio=aio.run))

        async def poll() -> None:
            while True:
                for entry in await lookup_any(tracker, query):
                    table.feed(Seen(entry))
                await trio.sleep(0.5)

        if tracker:
            nursery.start_soon(poll)
        with trio.move_on_after(timeout):
            while not mine():
                await table.changed.wait()
            await trio.sleep(0.5)  # a moment for more holders to answer
        nursery.cancel_scope.cancel()
    peers = mine()
    if not peers and not required:
        return Holders(query, 0, query, [])
    if not peers:
        raise errors.RouteError(f"no live node serves a model named {query!r} (looked for {timeout:.0f}s)")
    ids = {p.capability.model_fingerprint for p in peers}
    if len(ids) > 1:
        raise errors.RouteError(f"{query!r} names {len(ids)} different models: give more of the model id")
    cap = peers[0].capability
    return Holders(ids.pop(), cap.n_layer, cap.model_file or cap.model_name, peers)


async def manifest_for(holders: Holders) -> Manifest:
    """The model's manifest: kept here, or from the holders (checked against the id)."""
    kept = stored(holders.model_id)
    if kept is not None:
        return kept
    async with open_aio_thread(name="meshnode-fetch") as aio:
        got: Manifest = await aio.run(fetch_manifest, [p.endpoint for p in holders.peers], holders.model_id)
    from meshnode.modelid.local import store

    store(got)
    return got


def check_tensors(part: PartialModel, names: set[str]) -> None:
    """Read back every tensor in ``names`` whole and check it against the manifest (IntegrityError)."""
    with part.path.open("rb", buffering=0) as fh:
        for t in part.manifest.tensors:
            if t.name not in names:
                continue
            h = hashlib.sha256()
            fh.seek(t.offset)
            left = t.n_bytes
            while left:
                block = fh.read(min(left, 1 << 22))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            if h.hexdigest() != t.sha256:
                raise errors.IntegrityError(f"{t.name} in {part.path} does not match the model's manifest after "
                                            "the fetch: its pieces are fetched again next time")


async def fetch_range(holders: Holders, start: int, end: int, *, root: Path | None = None) -> tuple[Path, FetchReport]:
    """The model file with what [start, end) needs of it, fetched from ``holders`` (resuming a fetch
    kept here); returns its path (registered under the model id) and what came from whom."""
    endpoints = [p.endpoint for p in holders.peers]
    manifest = stored(holders.model_id)
    part = PartialModel.open(holders.model_id, root) if manifest is not None else None
    async with open_aio_thread(name="meshnode-fetch") as aio:
        if part is None:
            got: Manifest = manifest if manifest is not None else await aio.run(fetch_manifest, endpoints,
                                                                                 holders.model_id)
            part = PartialModel(got, root)
        with part:
            header = [Piece(0, part.manifest.header_bytes, part.manifest.header_sha256, "header")]
            report = await aio.run(functools.partial(fetch_pieces, part, header, endpoints, desc="the header"))
            names = source_reads(read_meta(part.path), start, end)
            want = pieces(part.manifest, names)
            size = sum(p.length for p in part.missing(want))
            check_room(size, f"fetching layers {start}:{end}")
            log.info("fetching layers %d:%d of %s (%d MB of %d MB) from %d peers", start, end, holders.name,
                     size >> 20, part.manifest.size >> 20, len(endpoints))
            more = await aio.run(functools.partial(fetch_pieces, part, want, endpoints,
                                                   desc=f"layers {start}:{end} of {holders.name}"))
            for k, v in more.by_peer.items():
                report.by_peer[k] = report.by_peer.get(k, 0) + v
            report.pieces += more.pieces
            report.bytes += more.bytes
            report.dropped.update(more.dropped)
            try:
                await trio.to_thread.run_sync(check_tensors, part, names)
            except errors.IntegrityError:
                part.forget({p.offset for p in want})
                raise
            return part.finish(), report


def is_fetched(path: Path) -> bool:
    """Whether ``path`` is a model file this machine fetched in part (served only for what it holds)."""
    try:
        return path.resolve().parent.parent == fetched_dir().resolve()
    except OSError:
        return False
