"""The tracker's HTTP API and status page.

    POST /api/register   body: a SignedEnvelope(Advertisement), application/x-protobuf
    GET  /api/status     models (coverage map per layer) and nodes, as JSON
    GET  /api/lookup?model=NAME_OR_FINGERPRINT   the live nodes of one model (dead ones left out; misbehaving
                         ones flagged and last)
    POST /api/evidence   body: a SignedEnvelope(Evidence): a report that a hop lied (tracker/evidence.py)
    POST /api/sync/...   records from and to peer trackers (``--peer``; tracker/peering.py)
    GET  /api/evidence/ID   its verdict (ID: the sha256 of the body)
    GET  /api/series?window=SECONDS&step=SECONDS   tokens/s per node and per model over the last 15 minutes
                         (meshnode/web/mapseries.py), for the page's charts
    GET  /               the status page and mesh map (meshnode/web/static/tracker.html; it reads /api/status
                         every 2 s and /api/series every 5 s); its scripts and styles under /assets

Every answer carries a Content-Security-Policy that allows only the page's own scripts, styles and
fetches (``meshnode.web.secure``): no inline script or style anywhere.

Every registration is verified (signature, signer = node id, attestation,
freshness, seq strictly newer); a forgery or replay is refused with 403 and
the error code, and changes nothing; a body over ``MAX_REGISTER_BODY`` is
refused with 413 before it is read (evidence: over ``MAX_EVIDENCE_BYTES``, 64 MiB). What one source
address may register is bounded (tracker/limits.py): over its rate, 429 with ``Retry-After`` before
anything is verified; over its entries, 429; a full table, 503. Every other answer to a malformed request
(bad framing, a huge head) is hypercorn's (``meshnode/http/serve.py``).
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from meshnode import errors
from meshnode.audit.evidence import MAX_EVIDENCE_BYTES
from meshnode.directory.records import RecordRefused, check
from meshnode.http.serve import asgi_app, error_response, json_response, read_body
from meshnode.identity.advert import verify_advert
from meshnode.proto import node_pb2 as pb
from meshnode.web import asset_mount, mapseries, page, secure
from tracker import views
from tracker.evidence import Verifier
from tracker.limits import RateTable
from tracker.peering import MAX_SYNC_BODY, Peering
from tracker.registry import Registry

log = logging.getLogger("meshnode.tracker")

#: bytes a registration may carry (a SignedEnvelope(Advertisement) is a few kB)
MAX_REGISTER_BODY = 64 * 1024
#: seconds an evidence body may take to arrive (it may be 64 MiB)
EVIDENCE_BODY_SECONDS = 120.0
#: every method reaches ``Tracker.handle``, which answers 404 for what it does not serve
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


@dataclass
class Tracker:
    registry: Registry
    #: verifies reports that a hop lied (its models: --verify-model; None: one without models, every report
    #: is answered 422 and marks nothing)
    verifier: Verifier | None = None
    #: evidence per source address (tracker/limits.py)
    evidence_rates: RateTable = field(init=False)
    #: peer trackers this one syncs with (tracker/peering.py); None: none
    peering: Peering | None = None
    #: records refused, by reason (forged, foreign_key, stale, expired, far_future, oversized, malformed)
    refused: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.verifier is None:
            self.verifier = Verifier(self.registry, {}, Path(tempfile.gettempdir()))
        b = self.registry.bounds
        self.evidence_rates = RateTable(b.evidence_per_minute / 60.0, b.evidence_burst)

    def asgi(self) -> ASGIApp:
        """The ASGI app (served by ``meshnode.http.serve.serve_asgi``): every request goes to ``handle``."""
        return secure(asgi_app([asset_mount(), Route("/{path:path}", self.handle, methods=METHODS)]))

    async def handle(self, req: Request) -> Response:
        route = (req.method, req.url.path)
        if route == ("POST", "/api/register"):
            source = req.client.host if req.client is not None else ""
            wait = self.registry.rates.take(source, time.time())
            if wait > 0:  # before the body is read or a signature checked: a flood costs a lookup each
                b = self.registry.bounds
                resp = error_response(429, "RATE_LIMITED", f"{source} sends more registrations than "
                                      f"{b.per_source_per_minute:g} a minute (--register-rate); retry in {wait:.1f}s")
                resp.headers["Retry-After"] = str(math.ceil(wait))
                return resp
            return self.register(await read_body(req, MAX_REGISTER_BODY), source)
        if route == ("POST", "/api/evidence"):
            return await self.evidence(req)
        if req.method == "POST" and req.url.path.startswith("/api/sync/"):
            return await self.sync(req)
        if req.method == "GET" and req.url.path.startswith("/api/evidence/"):
            assert self.verifier is not None
            status, doc = self.verifier.result(req.url.path.removeprefix("/api/evidence/"))
            return json_response(doc, status)
        if route == ("GET", "/api/status"):
            now = time.time()
            doc = views.status(views.current(self.registry, now, full=views.MAX_NODES_SHOWN))
            peers = self.peering.view() if self.peering is not None else []
            return json_response({**doc, "misbehaving": views.marks(self.registry, now), "peers": peers,
                                  "refused": dict(self.refused), "routes": views.routes_in_use(self.registry, now),
                                  "records": len(self.peering.mirror.records) if self.peering else None})
        if route == ("GET", "/api/lookup"):
            query = req.query_params.get("model", "")
            found = views.current(self.registry, time.time(), query, full=views.MAX_LOOKUP)
            return json_response(views.lookup(found, query))
        if route == ("GET", "/api/series"):
            return self.series(req)
        if route == ("GET", "/"):
            return page("tracker.html")
        if route == ("GET", "/healthz"):
            return json_response({"ok": True})
        return error_response(404, "NOT_FOUND", f"no route {req.method} {req.url.path}")

    def series(self, req: Request) -> Response:
        """Tokens/s per node and per model (meshnode/web/mapseries.py); 400 for a window or step that is not
        a number (numbers are clamped to what is kept)."""
        try:
            window, step = mapseries.parse_window(req.query_params.get("window"), req.query_params.get("step"))
        except ValueError as e:
            return error_response(400, errors.InputError.code, f"window and step are seconds: {e}")
        now = time.time()
        doc = mapseries.series_doc(self.registry.series, views.charted(self.registry, now), now, window, step)
        return json_response(doc)

    async def evidence(self, req: Request) -> Response:
        """A report that a hop lied: rate-limited per source before anything is read, then verified."""
        source = req.client.host if req.client is not None else ""
        wait = self.evidence_rates.take(source, time.time())
        if wait > 0:
            b = self.registry.bounds
            resp = error_response(429, "RATE_LIMITED", f"{source} sends more evidence than "
                                  f"{b.evidence_per_minute:g} a minute; retry in {wait:.1f}s")
            resp.headers["Retry-After"] = str(math.ceil(wait))
            return resp
        assert self.verifier is not None
        status, doc = await self.verifier.submit(await read_body(req, MAX_EVIDENCE_BYTES, EVIDENCE_BODY_SECONDS))
        return json_response(doc, status)

    async def sync(self, req: Request) -> Response:
        """A peer tracker's sync request (tracker/peering.py); 404 when this tracker has no peering."""
        if self.peering is None:
            return error_response(404, "NOT_FOUND", "this tracker syncs with no peers (--peer)")
        source = req.client.host if req.client is not None else ""
        path = req.url.path.removeprefix("/api/sync/")
        try:
            body = await read_body(req, MAX_SYNC_BODY)
            if path == "digest":
                return json_response(self.peering.digest_answer(body))
            if path == "fetch":
                return Response(self.peering.fetch_answer(body), media_type="application/x-protobuf")
            if path == "records":
                return json_response(self.peering.records_answer(body, f"peer {source}"))
        except errors.MeshnodeError as e:
            return error_response(400, e.code, e.message)
        return error_response(404, "NOT_FOUND", f"no route POST {req.url.path}")

    def accept_from_peer(self, env: pb.SignedEnvelope, source: str) -> bool:
        """A record a peer tracker sent: the registration's checks; kept if they hold (bounded as a node's)."""
        return self.register(env.SerializeToString(), source, from_peer=True).status_code == 200

    def register(self, body: bytes, source: str = "", *, from_peer: bool = False) -> Response:
        now = time.time()
        try:
            env = pb.SignedEnvelope.FromString(body)
            node_id = pb.Advertisement.FromString(env.payload).capability.node_id
            known = self.registry.last_seq(node_id)
            try:
                ad = verify_advert(env, now=int(now), last_seq=known)
            except errors.MeshnodeError:
                self.refused[_reason(env, int(now), known)] += 1
                raise
            try:  # and the directory's own (its expiry: meshnode/directory/records.py), as every store runs them
                check(env, now=int(now), known_seq=known, attest=False)
            except RecordRefused as r:
                self.refused[r.reason] += 1
                raise
        except errors.MeshnodeError as e:
            if not from_peer:  # a peer's stale copies are routine: counted there, not logged
                log.warning("refused a registration: %s", e)
            return error_response(403, e.code, e.message)
        except Exception as e:  # protobuf DecodeError on garbage
            return error_response(400, "PAYLOAD_CORRUPT", f"not a signed advertisement: {e}")
        if from_peer:  # bounded per the node's own address, as the tracker it registered with bounded it
            eps = ad.capability.endpoints
            source = eps[0].rpartition(":")[0] if eps else source
        slot = self.registry.place(node_id, source, now)
        if not slot.admit:
            log.warning("refused node %s from %s: %s", node_id, source, slot.why)
            return error_response(slot.status, "RESOURCE_EXHAUSTED", slot.why)
        if slot.evict is not None:
            log.info("node %s (never reached by a probe) makes room for %s", slot.evict, node_id)
            self.registry.remove(slot.evict)
        self.registry.register(env, ad, now, source)
        if not from_peer and not ad.leaving:  # a heartbeat's counters, fresh now: a sample for the charts
            self.registry.series.add(node_id, now, ad.health.tokens_total)
        if self.peering is not None:
            self.peering.learned(env, now, from_peer=from_peer)
        return json_response({"ok": True, "ttl": self.registry.ttl, "leaving": ad.leaving})


def _reason(env: pb.SignedEnvelope, now: int, known: int | None) -> str:
    """Why a registration was refused, as the directory counts it (its checks; else: not fresh)."""
    try:
        check(env, now=now, known_seq=known)
    except RecordRefused as r:
        return r.reason
    return "stale"
