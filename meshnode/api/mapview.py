"""The mesh map from any node's API: the tracker's view, built from the gateway's own peer table.

    GET /map               the page (meshnode/web/static/map.html: public; it asks for the key if the API has one)
    GET /v1/mesh           the status document the page draws (meshnode/web/mapdoc.py's shape); the API key
                           guards it as it guards /v1/models
    GET /v1/mesh/series?window=SECONDS&step=SECONDS   tokens/s per node and per model (meshnode/web/mapseries.py)

What it shows comes from the gateway alone: the nodes of its ``MeshView``
table (static peers, trackers, mDNS), each called with ``Health`` every
``PROBE_EVERY`` seconds. A node is **dead** when ``FAIL_LIMIT`` calls in a
row failed, or when it dropped out of the table (it stays on the map, dead,
for ``FORGET_AFTER`` seconds). The routes in use are what the heads report
in their Health answers (every gateway's sessions) and this gateway's own
sessions; the charts sample each node's ``tokens_total`` from the same calls.
A node is **misbehaving** once this gateway's own audits caught it lying
(``MeshView.caught``: no route of the gateway uses it again); the tracker's
page shows the reports the tracker verified, from every initiator.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from meshnode import errors
from meshnode.api import schema
from meshnode.api.mesh import MeshView
from meshnode.discovery.table import PeerEntry
from meshnode.proto import node_pb2 as pb
from meshnode.transport.client import health
from meshnode.web import mapdoc, mapseries, page
from meshnode.web.mapdoc import Known
from meshnode.web.mapseries import Charted, SeriesBook

if TYPE_CHECKING:
    from meshnode.api.app import Gateway

log = logging.getLogger("meshnode.api")

#: seconds between two rounds of Health calls
PROBE_EVERY = 2.0
#: the gRPC deadline of one Health call
PROBE_TIMEOUT = 1.5
#: failed calls in a row after which a node is dead
FAIL_LIMIT = 2
#: nodes remembered at most (the table's first; a node gone longest is forgotten first)
MAX_KNOWN = 512
#: Health calls running at once
MAX_IN_FLIGHT = 32
#: seconds a node that dropped out of the table stays on the map, dead
FORGET_AFTER = mapseries.WINDOW
#: characters of a failure kept
ERROR_CHARS = 160


@dataclass(frozen=True)
class Probed:
    """What this gateway's Health calls found of one node."""

    #: failed calls since the last answer
    failures: int = 0
    #: gateway clock of the start of the last answered call (None: never answered)
    last_ok: float | None = None
    #: that call's answer: the node's live counters and the routes it heads
    health: pb.HealthReply | None = None
    #: the last failure, in one line
    error: str = ""


def probed(state: Probed, at: float, reply: pb.HealthReply | None, error: str = "") -> Probed:
    """The state after one call started at ``at``: answered with ``reply``, or failed with ``error``."""
    if reply is not None:
        return Probed(0, at, reply, "")
    return replace(state, failures=state.failures + 1, error=error[:ERROR_CHARS])


@dataclass(frozen=True)
class Remembered:
    """A node the gateway's table held at some point."""

    #: its table entry, as last seen (its capability: model, range, endpoint)
    entry: PeerEntry
    #: gateway clock when the table last held it
    in_table_at: float
    probe: Probed = Probed()


def verdict(in_table: bool, p: Probed, fail_limit: int = FAIL_LIMIT) -> tuple[bool, str]:
    """Alive or dead, and why, for the map."""
    if not in_table:
        return False, "dropped out of this gateway's table"
    if p.failures >= fail_limit:
        return False, f"{p.failures} Health calls failed: {p.error}"
    if p.last_ok is None:
        return True, "in the table, not called yet" if not p.failures else f"in the table; Health failed: {p.error}"
    return True, "answers Health" + (f" ({p.failures} call failed: {p.error})" if p.failures else "")


def remember(known: dict[str, Remembered], live: dict[str, PeerEntry], now: float) -> dict[str, Remembered]:
    """The nodes to show after the table read ``live`` at ``now``: every one in it (kept up to date), those
    that dropped out less than FORGET_AFTER ago; at most MAX_KNOWN (those in the table first)."""
    out: dict[str, Remembered] = {}
    for nid, e in sorted(live.items())[:MAX_KNOWN]:
        old = known.get(nid)
        probe = old.probe if old is not None and old.entry.endpoint == e.endpoint else Probed()
        out[nid] = Remembered(e, now, probe)
    gone = sorted((r for nid, r in known.items() if nid not in live and now - r.in_table_at < FORGET_AFTER),
                  key=lambda r: -r.in_table_at)
    for r in gone[:max(0, MAX_KNOWN - len(out))]:
        out[r.entry.node_id] = r
    return out


def node_view(r: Remembered, in_table: bool, now: float) -> dict[str, Any]:
    """One node, as the map and its table read it (the tracker's node fields the page uses)."""
    cap, p = r.entry.capability, r.probe
    alive, reason = verdict(in_table, p)
    h = p.health or pb.HealthReply()
    return {"node_id": r.entry.node_id, "endpoints": [r.entry.endpoint], "model": cap.model_fingerprint,
            "model_name": cap.model_name, "n_layer": cap.n_layer, "range": [cap.range.start, cap.range.end],
            "role": cap.role, "source": r.entry.source, "alive": alive, "liveness_reason": reason,
            "misbehaving": False, "live_sessions": h.live_sessions, "free_sessions": h.free_sessions,
            "tokens_total": h.tokens_total,
            "counters_age_seconds": None if p.last_ok is None else round(max(0.0, now - p.last_ok), 1)}


def own_reports(held: dict[tuple[str, ...], int], by_endpoint: dict[str, str]) -> list[tuple[str, list[pb.RouteInUse]]]:
    """This gateway's own sessions as reports of their heads (endpoints turned into node ids; a route with
    an endpoint no known node has is left out)."""
    out = []
    for endpoints, n in held.items():
        hops = [by_endpoint.get(e) for e in endpoints]
        if hops and all(hops):
            out.append((str(hops[0]), [pb.RouteInUse(hops=[str(h) for h in hops], sessions=n)]))
    return out


class MapView:
    """The API's map: its own Health calls to the table's nodes, and the three routes."""

    def __init__(self, mesh: MeshView, denied: Callable[[Request], Response | None],
                 nursery: Callable[[], trio.Nursery | None] = lambda: None) -> None:
        self.mesh, self.denied, self._nursery = mesh, denied, nursery
        self.known: dict[str, Remembered] = {}
        self.series = SeriesBook()
        self.running = False

    def routes(self) -> list[BaseRoute]:
        return [Route("/map", self.page, methods=["GET"]), Route("/v1/mesh", self.status_answer, methods=["GET"]),
                Route("/v1/mesh/series", self.series_answer, methods=["GET"])]

    def start(self) -> None:
        """Start the Health calls in the gateway's nursery, once there is one."""
        nursery = self._nursery()
        if not self.running and nursery is not None:
            self.running = True
            nursery.start_soon(self.run)

    async def run(self) -> None:
        """A round of Health calls every PROBE_EVERY seconds, until cancelled."""
        self.running = True
        limit = trio.CapacityLimiter(MAX_IN_FLIGHT)
        while True:
            deadline = trio.current_time() + PROBE_EVERY
            async with trio.open_nursery() as nursery:
                for nid in self.read_table(time.time()):
                    nursery.start_soon(self.call, nid, limit)
            await trio.sleep_until(deadline)

    def read_table(self, now: float) -> list[str]:
        """Take the table's nodes in; the ids to call (those in it)."""
        live = self.mesh.table.live()
        self.known = remember(self.known, live, now)
        self.series.keep(self.known)
        return [nid for nid in self.known if nid in live]

    async def call(self, nid: str, limit: trio.CapacityLimiter) -> None:
        r = self.known.get(nid)
        if r is None:
            return
        cap = r.entry.capability
        at = time.time()
        reply: pb.HealthReply | None = None
        error = ""
        async with limit:
            try:
                with trio.fail_after(PROBE_TIMEOUT + 1.0):
                    reply = await self.mesh.aio(functools.partial(health, r.entry.endpoint, PROBE_TIMEOUT, nid,
                                                                  plaintext=cap.insecure))
            except errors.MeshnodeError as e:
                error = e.message
            except trio.TooSlowError:
                error = f"no answer within {PROBE_TIMEOUT:g} s"
            except Exception as e:  # an endpoint is a node's claim: whatever grpc raises, keep calling the others
                error = repr(e)
        latest = self.known.get(nid)
        if latest is None or latest.entry.endpoint != r.entry.endpoint:
            return  # forgotten, or moved, meanwhile
        self.known[nid] = replace(latest, probe=probed(latest.probe, at, reply, error))
        if reply is not None:
            self.series.add(nid, at, reply.tokens_total, probed=True)

    def status(self, now: float) -> dict[str, Any]:
        """The map's document: nodes, models (coverage by the live ones), routes in use."""
        live = self.mesh.table.live()
        views = [node_view(r, nid in live, now) for nid, r in self.known.items()]
        for nid, e in live.items():  # in the table since the last round: shown at once
            if nid not in self.known and len(views) < MAX_KNOWN:
                views.append(node_view(Remembered(e, now), True, now))
        for v in views:
            if (report := self.mesh.caught.get(v["node_id"])) is not None:
                v["misbehaving"], v["misbehaving_report"] = True, report
        views.sort(key=lambda v: (not v["alive"], v["model_name"], v["range"][0], v["node_id"]))
        by_id = {v["node_id"]: v for v in views}
        known = {v["node_id"]: Known(v["model"], v["range"][0], v["range"][1]) for v in views}
        reports = [(nid, list(r.probe.health.routes)) for nid, r in self.known.items()
                   if r.probe.health is not None and by_id.get(nid, {}).get("alive")]
        by_endpoint = {v["endpoints"][0]: v["node_id"] for v in views}
        routes = mapdoc.merge(mapdoc.routes(reports, known), mapdoc.routes(own_reports(self.mesh.routes, by_endpoint),
                                                                           known))
        return {"models": mapdoc.models(views), "nodes": views, "routes": routes,
                "omitted": {"nodes": 0, "models": 0}, "source": "api"}

    async def page(self, request: Request) -> Response:
        self.start()
        return page("map.html")

    async def status_answer(self, request: Request) -> Response:
        if (denied := self.denied(request)) is not None:
            return denied
        self.start()
        return JSONResponse(self.status(time.time()), headers={"Cache-Control": "no-store"})

    async def series_answer(self, request: Request) -> Response:
        if (denied := self.denied(request)) is not None:
            return denied
        self.start()
        try:
            window, step = mapseries.parse_window(request.query_params.get("window"), request.query_params.get("step"))
        except ValueError as e:
            return JSONResponse(schema.error_doc(f"window and step are seconds: {e}", "invalid_request_error",
                                                 errors.InputError.code), status_code=400)
        now = time.time()
        charted = [Charted(nid, r.entry.capability.model_fingerprint, r.entry.capability.model_name,
                           r.entry.capability.range.end == r.entry.capability.n_layer)
                   for nid, r in self.known.items() if nid in self.series.tracks]
        return JSONResponse(mapseries.series_doc(self.series, charted, now, window, step),
                            headers={"Cache-Control": "no-store"})


def map_routes(gateway: Gateway) -> list[BaseRoute]:
    """The map's routes for ``Gateway.asgi``: its Health calls start in the gateway's nursery (at once if
    ``run_api`` set it already, else at the first request), its JSON guarded by the gateway's key."""
    view = MapView(gateway.mesh, gateway._denied, lambda: gateway.nursery)
    view.start()
    return view.routes()
