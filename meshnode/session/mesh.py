"""Self-assembled routes: find peers of a model, measure them, choose the chain.

``find_route`` browses (mDNS now; the tracker joins the same peer table
later) until the peers of the model named cover every layer, gives late
replicas a moment to answer, measures each candidate's round trip and free
capacity with a Health call, and asks the pure ``choose_route``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import trio

from meshnode import errors
from meshnode.discovery.mdns import PeerTable, run_mdns
from meshnode.discovery.table import PeerEntry, Seen
from meshnode.discovery.tracker_client import ask_all, lookup_any, tracker_models
from meshnode.proto import node_pb2 as pb
from meshnode.routing.assign import MIN_PREFIX, is_short_prefix, model_matches
from meshnode.routing.choose import Candidate, choose_route
from meshnode.transport.aiothread import AioRun, via_trio_asyncio
from meshnode.transport.client import health

#: after the model is first covered, wait this long for more replicas
SETTLE = 0.5


def matches(entry: PeerEntry, query: str) -> bool:
    cap = entry.capability
    return model_matches(cap.model_fingerprint, cap.model_name, query, cap.model_file)


def covered(peers: list[PeerEntry]) -> bool:
    """Whether these peers' ranges can tile every layer of their model (free sessions or not)."""
    if not peers:
        return False
    n = peers[0].capability.n_layer
    try:
        choose_route([Candidate(p.node_id, p.endpoint, p.capability.range.start, p.capability.range.end,
                                1.0, 0.0, 1) for p in peers], n)
    except errors.RouteError:
        return False
    return True


async def _measure(entry: PeerEntry, aio: AioRun) -> Candidate | None:
    t0 = time.perf_counter()
    try:
        h = await aio(health, entry.endpoint, 3.0, entry.node_id)  # TLS pinned to the id the node advertised
    except errors.MeshnodeError:
        return None
    rtt = time.perf_counter() - t0
    cap = entry.capability
    return Candidate(entry.node_id, entry.endpoint, cap.range.start, cap.range.end,
                     cap.throughput.decode_tokens_per_second, rtt, h.free_sessions if h.serving else 0,
                     h.live_sessions)


async def candidates_of(table: PeerTable, query: str, timeout: float) -> list[PeerEntry]:
    """The peers of the model ``query``, once they cover it (or whatever is known at ``timeout``)."""
    with trio.move_on_after(timeout):
        while True:
            peers = [p for p in table.live().values() if matches(p, query)]
            if covered(peers):
                await trio.sleep(SETTLE)
                break
            await table.changed.wait()
    return [p for p in table.live().values() if matches(p, query)]


def seen_models(entries: Iterable[PeerEntry], tracked: Iterable[tuple[str, str]]) -> str:
    """"name (fingerprint prefix…), ..." of the models ``entries`` serve and the tracker knows. Pure."""
    models = {e.capability.model_fingerprint: e.capability.model_file or e.capability.model_name for e in entries}
    for fp, name in tracked:
        models.setdefault(fp, name)
    return ", ".join(f"{name} ({fp[:MIN_PREFIX]}…)" for fp, name in sorted(models.items(), key=lambda kv: kv[1]))


async def _tracker_models(tracker: str | Sequence[str] | None) -> list[tuple[str, str]]:
    """(fingerprint, name) of every model the trackers know; [] if none can say."""
    try:
        return await ask_all(tracker, tracker_models)
    except errors.MeshnodeError:
        return []


async def _poll_tracker(tracker: str | Sequence[str] | None, query: str, table: PeerTable) -> None:
    while True:
        for entry in await lookup_any(tracker, query):
            table.feed(Seen(entry))
        await trio.sleep(0.5)


async def _poll_directories(bootstrap: Sequence[str], query: str, table: PeerTable, aio: AioRun) -> None:
    """Peer exchange from the nodes given and, one step on, from the nodes they list: every record
    checked here (directory/records.py), the live ones fed to the table (docs/directory.md)."""
    from meshnode.directory.records import RecordRefused, check
    from meshnode.transport.client import records

    asked: set[str] = set()
    while True:
        targets = [*bootstrap, *(e.endpoint for e in table.live().values() if e.source == "directory")]
        for endpoint in dict.fromkeys(targets):
            if endpoint in asked and endpoint not in bootstrap:
                continue
            asked.add(endpoint)
            try:
                got = await aio(records, endpoint, pb.RecordsRequest(), 5.0)
            except errors.MeshnodeError:
                continue
            now = int(time.time())
            for env in got.records[:2000]:
                try:
                    rec = check(env, now=now)
                except RecordRefused:
                    continue
                cap = rec.advert.capability
                if cap.endpoints and not rec.advert.leaving:
                    table.feed(Seen(PeerEntry(cap.node_id, cap.endpoints[0], cap, "directory", time.time())))
        await trio.sleep(0.5)


async def find_route(query: str, *, mdns_interface: str | None = None, tracker: str | Sequence[str] | None = None,
                     timeout: float = 5.0, load: dict[str, int] | None = None,
                     aio: AioRun = via_trio_asyncio) -> list[str]:
    """Endpoints of the fastest route for model ``query`` (see ``discover``)."""
    return (await discover(query, mdns_interface=mdns_interface, tracker=tracker, timeout=timeout,
                           load=load, aio=aio)).route


@dataclass(frozen=True)
class Discovered:
    #: the chosen route's endpoints, in layer order
    route: list[str]
    #: every other reachable peer of the model: spares for a failover
    spares: list[str]


async def discover(query: str, *, mdns_interface: str | None = None, tracker: str | Sequence[str] | None = None,
                   bootstrap: Sequence[str] = (),
                   timeout: float = 5.0, load: dict[str, int] | None = None,
                   aio: AioRun = via_trio_asyncio) -> Discovered:
    """Endpoints of the fastest route for model ``query``, from mDNS and/or a tracker.

    ``load`` maps endpoints to the sessions the caller already runs through
    them, so that its concurrent sessions spread across replicas.

    Peers are probed over gRPC through ``aio`` (``AioThread.run``; the default
    needs the caller to have opened a trio-asyncio loop).
    """
    if is_short_prefix(query):
        raise errors.InputError(f"--mesh {query!r}: a fingerprint prefix needs {MIN_PREFIX}+ hex digits")
    table = PeerTable()
    async with trio.open_nursery() as nursery:
        if mdns_interface:
            await nursery.start(functools.partial(run_mdns, table, interface=mdns_interface, aio=aio))
        if tracker:
            nursery.start_soon(_poll_tracker, tracker, query, table)
        if bootstrap:
            nursery.start_soon(_poll_directories, bootstrap, query, table, aio)
        peers = await candidates_of(table, query, timeout)
        nursery.cancel_scope.cancel()
    if not peers:
        seen = seen_models(table.live().values(), await _tracker_models(tracker) if tracker else [])
        raise errors.RouteError(f"no reachable node serves a model named {query!r} (looked for {timeout:.0f}s); "
                                f"models seen: {seen or 'none'}")
    fingerprints = {p.capability.model_fingerprint for p in peers}
    if len(fingerprints) > 1:
        raise errors.RouteError(f"{query!r} names {len(fingerprints)} different models "
                                f"({seen_models(peers, [])}): give more of a fingerprint")
    return await choose_among(peers, aio, load=load)


async def choose_among(peers: list[PeerEntry], aio: AioRun, *, load: dict[str, int] | None = None) -> Discovered:
    """Measure ``peers`` (of one model) and choose the fastest route; the rest are its spares.

    ``load`` maps endpoints to the sessions the caller already runs through
    them. RouteError if the peers that answer do not cover the model;
    CapacityError if they would, but without a free session on some span.
    """
    measured: list[Candidate] = []
    async with trio.open_nursery() as nursery:
        async def one(p: PeerEntry) -> None:
            cand = await _measure(p, aio)
            if cand is not None:
                measured.append(cand)

        for p in peers:
            nursery.start_soon(one, p)
    n_layer = peers[0].capability.n_layer
    by_node = {c.node_id: (load or {}).get(c.endpoint, 0) for c in measured}
    try:
        route = choose_route(sorted(measured, key=lambda c: c.node_id), n_layer, load=by_node)
    except errors.RouteError:
        answering = {c.node_id for c in measured}
        if covered([p for p in peers if p.node_id in answering]):
            raise errors.CapacityError(f"every route of {peers[0].capability.model_name} is full: no free "
                                       "session on some span; try again shortly") from None
        raise
    chosen = [c.endpoint for c in route]
    return Discovered(chosen, sorted(c.endpoint for c in measured if c.endpoint not in chosen))
