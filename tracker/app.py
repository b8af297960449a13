"""The tracker's HTTP API and status page.

    POST /api/register   body: a SignedEnvelope(Advertisement), application/x-protobuf
    GET  /api/status     models (coverage map per layer) and nodes, as JSON
    GET  /api/lookup?model=NAME_OR_FINGERPRINT   the live nodes of one model (dead ones left out)
    GET  /               the status page (auto-refreshing, reads /api/status)

Every registration is verified (signature, signer = node id, attestation,
freshness, seq strictly newer); a forgery or replay is refused with 403 and
the error code, and changes nothing; a body over ``MAX_REGISTER_BODY`` is
refused with 413 before it is read. Every other answer to a malformed request
(bad framing, a huge head) is hypercorn's (``meshnode/httpserve.py``).
"""

from __future__ import annotations

import logging
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
            return self.register(await read_body(req, MAX_REGISTER_BODY))
        if route == ("GET", "/api/status"):
            return json_response(views.status(self._views()))
        if route == ("GET", "/api/lookup"):
            return json_response(views.lookup(self._views(), req.query_params.get("model", "")))
        if route == ("GET", "/"):
            return HTMLResponse(PAGE, headers=NO_STORE)
        if route == ("GET", "/healthz"):
            return json_response({"ok": True})
        return error_response(404, "NOT_FOUND", f"no route {req.method} {req.url.path}")

    def register(self, body: bytes) -> Response:
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
        self.registry.register(env, ad, now)
        return json_response({"ok": True, "ttl": self.registry.ttl, "leaving": ad.leaving})

    def _views(self) -> list[dict[str, object]]:
        return views.current(self.registry, time.time())  # judged with the prober's findings
