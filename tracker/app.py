"""The tracker's HTTP API and status page.

    POST /api/register   body: a SignedEnvelope(Advertisement), application/x-protobuf
    GET  /api/status     models (coverage map per layer) and nodes, as JSON
    GET  /api/lookup?model=NAME_OR_FINGERPRINT   the live nodes of one model (dead ones left out)
    GET  /               the status page (auto-refreshing, reads /api/status)

Every registration is verified (signature, signer = node id, attestation,
freshness, seq strictly newer); a forgery or replay is refused with 403 and
the error code, and changes nothing; a body over ``MAX_REGISTER_BODY`` is
refused with 413 before it is read. What one source address may register is
bounded (tracker/limits.py): over its rate, 429 with ``Retry-After`` before
anything is verified; over its entries, 429; a full table, 503. Every other answer to a malformed request
(bad framing, a huge head) is hypercorn's (``meshnode/httpserve.py``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from meshnode import errors
from meshnode.httpserve import NO_STORE, asgi_app, error_response, json_response, read_body
from meshnode.identity.advert import verify_advert
from meshnode.proto import node_pb2 as pb
from tracker import views
from tracker.page import PAGE
from tracker.registry import Registry

log = logging.getLogger("meshnode.tracker")

#: bytes a registration may carry (a SignedEnvelope(Advertisement) is a few kB)
MAX_REGISTER_BODY = 64 * 1024
#: every method reaches ``Tracker.handle``, which answers 404 for what it does not serve
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")


@dataclass
class Tracker:
    registry: Registry

    def asgi(self) -> ASGIApp:
        """The ASGI app (served by ``meshnode.httpserve.serve_asgi``): every request goes to ``handle``."""
        return asgi_app([Route("/{path:path}", self.handle, methods=METHODS)])

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
        if route == ("GET", "/api/status"):
            return json_response(views.status(views.current(self.registry, time.time(), full=views.MAX_NODES_SHOWN)))
        if route == ("GET", "/api/lookup"):
            query = req.query_params.get("model", "")
            found = views.current(self.registry, time.time(), query, full=views.MAX_LOOKUP)
            return json_response(views.lookup(found, query))
        if route == ("GET", "/"):
            return HTMLResponse(PAGE, headers=NO_STORE)
        if route == ("GET", "/healthz"):
            return json_response({"ok": True})
        return error_response(404, "NOT_FOUND", f"no route {req.method} {req.url.path}")

    def register(self, body: bytes, source: str = "") -> Response:
        now = time.time()
        try:
            env = pb.SignedEnvelope.FromString(body)
            node_id = pb.Advertisement.FromString(env.payload).capability.node_id
            ad = verify_advert(env, now=int(now), last_seq=self.registry.last_seq(node_id))
        except errors.MeshnodeError as e:
            log.warning("refused a registration: %s", e)
            return error_response(403, e.code, e.message)
        except Exception as e:  # protobuf DecodeError on garbage
            return error_response(400, "PAYLOAD_CORRUPT", f"not a signed advertisement: {e}")
        slot = self.registry.place(node_id, source, now)
        if not slot.admit:
            log.warning("refused node %s from %s: %s", node_id, source, slot.why)
            return error_response(slot.status, "RESOURCE_EXHAUSTED", slot.why)
        if slot.evict is not None:
            log.info("node %s (never reached by a probe) makes room for %s", slot.evict, node_id)
            self.registry.remove(slot.evict)
        self.registry.register(env, ad, now, source)
        return json_response({"ok": True, "ttl": self.registry.ttl, "leaving": ad.leaving})
