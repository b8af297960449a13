"""What the API gateway knows of the mesh: a peer table kept fresh, models it covers, routes.

The table is fed by the sources a user gives, as ``generate`` uses them:
static ``--peer`` endpoints (their capabilities re-read every ``refresh``
seconds), a tracker (every model's verified advertisements, re-read every
``refresh`` seconds) and mDNS (live). Every capability is attested before it
enters. ``route`` picks a route for one request from what is known now,
measuring the candidates' load with a Health call, so a request never waits
for discovery.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from meshnode import errors
from meshnode.discovery.mdns import PeerTable, run_mdns
from meshnode.discovery.table import PeerEntry, Seen
from meshnode.discovery.tracker_client import lookup_all_any
from meshnode.identity.attest import check_attested
from meshnode.session.mesh import Discovered, choose_among, covered, matches
from meshnode.transport.aiothread import AioRun
from meshnode.transport.client import get_capability

log = logging.getLogger("meshnode.api")
#: the most nodes the gateway remembers as caught lying (the oldest forgotten first)
MAX_CAUGHT = 1024


@dataclass(frozen=True)
class MeshSource:
    #: static peers (HOST:PORT), in any order: every one is a candidate hop
    peers: tuple[str, ...] = ()
    #: a tracker URL to read every model's nodes from
    #: one tracker's URL, or several (any one answering is enough)
    tracker: str | tuple[str, ...] | None = None
    #: an interface address to browse mDNS on
    mdns: str | None = None
    #: seconds between re-reads of the static peers and the tracker
    refresh: float = 2.0


@dataclass(frozen=True)
class Model:
    fingerprint: str
    #: general.name
    name: str
    #: the file name the nodes cut it from, without ``.gguf`` ("" if they do not say)
    file: str
    n_layer: int
    #: node ids serving some of its layers
    nodes: tuple[str, ...]
    #: whether the known nodes cover every layer
    covered: bool


class MeshView:
    """The gateway's peer table and the decisions read from it."""

    def __init__(self, source: MeshSource, aio: AioRun) -> None:
        self.source, self.aio = source, aio
        # entries of static peers and the tracker are re-fed every refresh: three refreshes missed is gone
        self.table = PeerTable(ttl=max(3 * source.refresh, 6.0))
        #: sessions this gateway has open per endpoint, so concurrent requests spread over replicas
        self.load: dict[str, int] = {}
        #: nodes this gateway's audits caught lying, by node id: what the map shows (the tracker's
        #: ``misbehaving_report`` shape); no route of this gateway uses them again
        self.caught: dict[str, dict[str, object]] = {}
        #: sessions this gateway has open per route (its hops' endpoints, in layer order): the map's routes in use
        self.routes: dict[tuple[str, ...], int] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the table fed until cancelled; started once every source was read once."""
        async with trio.open_nursery() as nursery:
            if self.source.mdns:
                await nursery.start(functools.partial(run_mdns, self.table, interface=self.source.mdns, aio=self.aio))
            if self.source.peers:
                await self._read_static()
                nursery.start_soon(self._every, self._read_static)
            if self.source.tracker:
                await self._read_tracker()
                nursery.start_soon(self._every, self._read_tracker)
            task_status.started()

    async def _every(self, read: Callable[[], Awaitable[None]]) -> None:
        while True:
            await trio.sleep(self.source.refresh)
            await read()

    async def _read_static(self) -> None:
        async def one(endpoint: str) -> None:
            try:
                cap = await self.aio(get_capability, endpoint, 3.0)
                check_attested(endpoint, cap, int(time.time()))
            except errors.MeshnodeError as e:
                log.debug("peer %s not usable: %s", endpoint, e)
                return
            self.table.feed(Seen(PeerEntry(cap.node_id, endpoint, cap, "static", time.time())))

        async with trio.open_nursery() as nursery:
            for p in self.source.peers:
                nursery.start_soon(one, p)

    async def _read_tracker(self) -> None:
        assert self.source.tracker
        try:
            entries = await lookup_all_any(self.source.tracker)
        except errors.MeshnodeError as e:
            log.warning("tracker %s: %s", self.source.tracker, e)
            return
        for entry in entries:
            self.table.feed(Seen(entry))

    def models(self) -> list[Model]:
        """Every model some known node serves, by name."""
        by_fp: dict[str, list[PeerEntry]] = {}
        for p in self.table.live().values():
            by_fp.setdefault(p.capability.model_fingerprint, []).append(p)
        return sorted((Model(fp, ps[0].capability.model_name, ps[0].capability.model_file.removesuffix(".gguf"),
                             ps[0].capability.n_layer,
                             tuple(sorted(p.node_id for p in ps)), covered(ps)) for fp, ps in by_fp.items()),
                      key=lambda m: (m.name, m.fingerprint))

    def resolve(self, query: str) -> list[PeerEntry]:
        """The known peers of the one model ``query`` names.

        ModelNotFoundError (listing the models known) if none; InputError if it names several.
        """
        peers = [p for p in self.table.live().values() if matches(p, query) and p.node_id not in self.caught]
        if not peers:
            known = ", ".join(f"{m.name} ({m.fingerprint[:12]})" for m in self.models()) or "none"
            raise errors.ModelNotFoundError(f"no known node serves a model named {query!r}; known models: {known}")
        fps = {p.capability.model_fingerprint for p in peers}
        if len(fps) > 1:
            raise errors.InputError(f"{query!r} names {len(fps)} different models; give a fingerprint prefix")
        return peers

    def note_caught(self, audit: Mapping[str, object], reporter: str, now: float) -> None:
        """Remember the hops a generation's audit caught lying (``GenerationResult.audit``'s ``caught``)."""
        caught = audit.get("caught")
        for c in caught if isinstance(caught, list) else []:
            try:
                start, end = (int(x) for x in str(c["layers"]).split(":"))
                self.caught[str(c["node_id"])] = {"pos_start": int(c["position"]), "range": [start, end],
                                                  "reporter": reporter, "at_unix": int(now)}
            except (KeyError, TypeError, ValueError):
                log.warning("an audit's report of a lie lacks its fields: %r", c)
        while len(self.caught) > MAX_CAUGHT:
            del self.caught[next(iter(self.caught))]

    async def route(self, query: str) -> Discovered:
        """A route (and its spares) for one request of model ``query``, chosen from what is known now.

        ModelNotFoundError, RouteError (the known nodes do not cover it),
        CapacityError (they do, but none has a free session).
        """
        return await choose_among(self.resolve(query), self.aio, load=self.load)

    def hold(self, endpoints: Sequence[str]) -> None:
        for e in endpoints:
            self.load[e] = self.load.get(e, 0) + 1
        key = tuple(endpoints)
        self.routes[key] = self.routes.get(key, 0) + 1

    def unhold(self, endpoints: Sequence[str]) -> None:
        for e in endpoints:
            self.load[e] -= 1
            if not self.load[e]:
                del self.load[e]
        key = tuple(endpoints)
        self.routes[key] -= 1
        if not self.routes[key]:
            del self.routes[key]
