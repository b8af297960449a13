"""The tracker's HTTP API and status page.

    POST /api/register   body: a SignedEnvelope(Advertisement), application/x-protobuf
    GET  /api/status     models (coverage map per layer) and nodes, as JSON
    GET  /api/lookup?model=NAME_OR_FINGERPRINT   the live nodes of one model (dead ones left out)
    GET  /               the status page (auto-refreshing, reads /api/status)

Every registration is verified (signature, signer = node id, attestation,
freshness, seq strictly newer); a forgery or replay is refused with 403 and
the error code, and changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from meshnode import errors
from meshnode.httpmini import Request, Response
from meshnode.identity.advert import verify_advert
from meshnode.proto import node_pb2 as pb
from tracker import views
from tracker.page import PAGE
from tracker.registry import Registry

log = logging.getLogger("meshnode.tracker")


@dataclass
class Tracker:
    registry: Registry

    async def handle(self, req: Request) -> Response:
        route = (req.method, req.path)
        if route == ("POST", "/api/register"):
            return self.register(req.body)
        if route == ("GET", "/api/status"):
            return Response.json(views.status(self._views()))
        if route == ("GET", "/api/lookup"):
            return Response.json(views.lookup(self._views(), req.query.get("model", "")))
        if route == ("GET", "/"):
            return Response(200, PAGE.encode(), "text/html; charset=utf-8")
        if route == ("GET", "/healthz"):
            return Response.json({"ok": True})
        return Response.json({"error": "NOT_FOUND", "message": f"no route {req.method} {req.path}"}, 404)

    def register(self, body: bytes) -> Response:
        now = time.time()
        try:
            env = pb.SignedEnvelope.FromString(body)
            node_id = pb.Advertisement.FromString(env.payload).capability.node_id
            ad = verify_advert(env, now=int(now), last_seq=self.registry.last_seq(node_id))
        except errors.MeshnodeError as e:
            log.warning("refused a registration: %s", e)
            return Response.json({"error": e.code, "message": e.message}, 403)
        except Exception as e:  # protobuf DecodeError on garbage
            return Response.json({"error": "PAYLOAD_CORRUPT", "message": f"not a signed advertisement: {e}"}, 400)
        self.registry.register(env, ad, now)
        return Response.json({"ok": True, "ttl": self.registry.ttl, "leaving": ad.leaving})

    def _views(self) -> list[dict[str, object]]:
        return views.current(self.registry, time.time())  # judged with the prober's findings
