"""The OpenAI-compatible HTTP API: an ASGI app served by hypercorn (``meshnode.http.serve``).

    GET  /v1/models             models the known mesh fully covers
    POST /v1/completions        raw completion; ``stream: true`` = server-sent events
    POST /v1/chat/completions   chat through the model's own template; streams the same way
    GET  /healthz               liveness
    GET  /                      the chat page (meshnode/web/static/chat.html); its assets under /assets

Each request runs one route session (``session.initiator.generate`` on the
gateway's asyncio thread), chosen from the ``MeshView`` at that moment;
concurrent requests are concurrent sessions, which the hops batch. A request
whose client goes away -- a stream cut mid-answer, or a plain request
abandoned -- cancels its generation, and the initiator's cancellation
releases the session on every hop at once. Errors are OpenAI's error bodies
with the status of ``schema.error_status`` (400, 401, 404, 413, 429, 503, 504).
"""

from __future__ import annotations

import codecs
import functools
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from meshnode import errors
from meshnode.api import schema
from meshnode.api.mapview import map_routes
from meshnode.api.mesh import MeshView
from meshnode.audit.policy import Ledger
from meshnode.discovery.tracker_client import urls_of
from meshnode.http.serve import read_body
from meshnode.http.tls import TLSFiles
from meshnode.identity import NodeIdentity
from meshnode.session.initiator import GenerateConfig, GenerationResult, generate
from meshnode.session.sampling import random_seed
from meshnode.transport.aiothread import AioThread
from meshnode.web import asset_mount, page, secure

log = logging.getLogger("meshnode.api")


@dataclass(frozen=True)
class ApiConfig:
    #: HOST:PORT to listen on (loopback by default: no key needed there)
    listen: str = "127.0.0.1:8080"
    #: Bearer token every request must carry (None: none; required off loopback)
    api_key: str | None = None
    #: bytes a request body may have
    max_body: int = 1024 * 1024
    #: seconds one request may take end to end before it is cut with 504
    deadline: float = 600.0
    #: seconds each step of a generation may take (a hop that stalls longer fails the request)
    step_timeout: float = 30.0
    #: HTTPS certificate and key (meshnode.http.tls); None: plain HTTP, loopback only unless ``insecure``
    tls: TLSFiles | None = None
    #: plain HTTP off loopback allowed (``--insecure``: a closed lab network)
    insecure: bool = False
    #: speculative decoding unless a request says otherwise: "" (off) or "ngram", and its most tokens a step
    draft: str = ""
    draft_max: int = 8


#: what a generation reports to the request handling it, in order: pieces of text, then the end
Event = tuple[str, Any]  # ("text", str) | ("done", GenerationResult) | ("error", MeshnodeError)


class Gateway:
    """The API's request handling; ``nursery`` (set by ``run_api``) hosts the generations."""

    def __init__(self, mesh: MeshView, aio: AioThread, config: ApiConfig) -> None:
        self.mesh, self.aio, self.config = mesh, aio, config
        self.nursery: trio.Nursery | None = None
        #: the gateway signs its route sessions with a key of its own, made at start (it keeps no state)
        self.ident = NodeIdentity.generate()
        #: which nodes passed their audits, for this process's life (docs/security.md, "A hop that lies")
        self.ledger = Ledger(None)

    def asgi(self) -> ASGIApp:
        routes = [Route("/", self.chat_page, methods=["GET"]), asset_mount(),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/completions", functools.partial(self.answer, schema.parse_completion), methods=["POST"]),
                  Route("/v1/chat/completions", functools.partial(self.answer, schema.parse_chat), methods=["POST"]),
                  Route("/healthz", self.healthz, methods=["GET"]),
                  *map_routes(self)]  # the mesh map: /map, /v1/mesh, /v1/mesh/series (meshnode/api/mapview.py)
        return secure(Starlette(routes=routes, exception_handlers={HTTPException: _http_error}))

    async def chat_page(self, request: Request) -> Response:
        return page("chat.html")

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        # the id is the file name (what `model pull` shows); its general name and fingerprint name it too
        data = [{"id": m.file or m.name, "object": "model", "created": 0, "owned_by": "meshnode", "name": m.name,
                 "fingerprint": m.fingerprint, "n_layer": m.n_layer, "nodes": len(m.nodes)}
                for m in self.mesh.models() if m.covered]
        return JSONResponse({"object": "list", "data": data})

    def _denied(self, request: Request) -> Response | None:
        key = self.config.api_key
        if key is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return None
        return _error(401, "a valid API key is required: Authorization: Bearer KEY", "authentication_error",
                      "invalid_api_key")

    async def answer(self, parse: Callable[[object], schema.Job], request: Request) -> Response:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            body = await read_body(request, self.config.max_body)
            try:
                doc = json.loads(body)
            except ValueError as e:
                raise errors.InputError(f"the request body is not JSON: {e}") from None
            job = parse(doc)
            if job.sampling.temperature > 0 and not job.seeded:
                job = replace(job, sampling=replace(job.sampling, seed=random_seed()))
            events, scope = await self._start(job)
            try:
                first = await events.receive()
            except trio.EndOfChannel:  # cut by the deadline before anything came
                return _timeout(self.config.deadline)
            if first[0] == "error":
                raise first[1]
        except errors.MeshnodeError as e:
            status, kind = schema.error_status(e)
            return _error(status, e.message, kind, e.code)
        answer = schema.Answer(schema.new_id(job.kind), job.kind, job.model,
                               seed=job.sampling.seed if job.sampling.temperature > 0 else None)
        if job.stream:
            return StreamingResponse(self._sse(answer, job, first, events, scope), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        return await self._whole(request, answer, first, events, scope)

    async def _start(self, job: schema.Job) -> tuple[trio.MemoryReceiveChannel[Event], trio.CancelScope]:
        """Start one generation in the gateway's nursery; its events arrive on the channel returned."""
        assert self.nursery is not None, "Gateway.nursery is set by run_api"
        send, recv = trio.open_memory_channel[Event](math.inf)
        scope = trio.CancelScope(deadline=trio.current_time() + self.config.deadline)
        self.nursery.start_soon(self._run, job, send, scope)
        return recv, scope

    async def _run(self, job: schema.Job, send: trio.MemorySendChannel[Event], scope: trio.CancelScope) -> None:
        token = trio.lowlevel.current_trio_token()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

        def on_token(tok: int | None, piece: bytes) -> None:  # on the asyncio thread
            text = decoder.decode(piece, final=tok is None)
            if text:
                token.run_sync_soon(send.send_nowait, ("text", text))

        cfg = GenerateConfig(prompt=job.prompt, messages=job.messages, max_tokens=job.max_tokens or 0,
                             sampling=job.sampling, stop=job.stop, step_timeout=self.config.step_timeout,
                             draft=self.config.draft if job.draft is None else "" if job.draft == "none" else job.draft,
                             draft_max=job.draft_max or self.config.draft_max,
                             report_to=tuple(urls_of(self.mesh.source.tracker)))
        with send, scope:
            try:
                found = await self.mesh.route(job.model)
                self.mesh.hold(found.route)
                try:
                    result = await self.aio.run(functools.partial(generate, found.route, cfg, self.ident,
                                                                  spares=found.spares,
                                                                  on_token=on_token, ledger=self.ledger))
                finally:
                    self.mesh.unhold(found.route)
                self.mesh.note_caught(result.audit, self.ident.node_id, time.time())
                await _drain_soon(token)  # the pieces the asyncio thread posted arrive before the end
                send.send_nowait(("done", result))
            except errors.MeshnodeError as e:
                send.send_nowait(("error", e))
            except Exception as e:  # a bug of ours: this request gets a 500, the gateway keeps serving
                log.exception("a request failed inside the gateway")
                send.send_nowait(("error", errors.MeshnodeError(f"internal error: {e!r}")))

    async def _whole(self, request: Request, answer: schema.Answer, first: Event,
                     events: trio.MemoryReceiveChannel[Event], scope: trio.CancelScope) -> Response:
        """A plain (non-streamed) answer; cancelled if the client goes away meanwhile."""
        pieces: list[str] = []
        end: Event | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, request, scope)
            async for event in _with_first(first, events):
                if event[0] == "text":
                    pieces.append(event[1])
                else:
                    end = event
            nursery.cancel_scope.cancel()
        if end is None:  # cut: by the deadline, or the client went away (then nobody reads this)
            return _timeout(self.config.deadline)
        if end[0] == "error":
            status, kind = schema.error_status(end[1])
            return _error(status, end[1].message, kind, end[1].code)
        result: GenerationResult = end[1]
        doc = answer.whole("".join(pieces), result.stop_reason, len(result.prompt_tokens), len(result.tokens))
        if result.draft:  # meshnode's extension: what speculative decoding did for this answer
            doc["draft"] = result.draft
        doc["meshnode"] = schema.served(result)
        return JSONResponse(doc)

    async def _sse(self, answer: schema.Answer, job: schema.Job, first: Event,
                   events: trio.MemoryReceiveChannel[Event], scope: trio.CancelScope) -> AsyncIterator[bytes]:
        """The answer as server-sent events. Starlette cancels this iterator when the client goes
        away; the ``finally`` then cancels the generation (which releases the session on every hop)."""
        try:
            opened = False
            async for event in _with_first(first, events):
                if event[0] == "text":
                    yield _sse(answer.chunk(event[1], first=not opened))
                    opened = True
                elif event[0] == "error":
                    _, kind = schema.error_status(event[1])
                    yield _sse(schema.error_doc(event[1].message, kind, event[1].code))
                else:
                    result: GenerationResult = event[1]
                    # the last chunk carries meshnode's extension: the route that served it, its speed
                    yield _sse(answer.chunk(None, schema.finish_reason(result.stop_reason), first=not opened)
                               | {"meshnode": schema.served(result)})
                    if job.include_usage:
                        yield _sse(answer.usage_chunk(len(result.prompt_tokens), len(result.tokens)))
            if scope.cancelled_caught:
                yield _sse(schema.error_doc(f"the request took longer than {self.config.deadline:g}s",
                                            "timeout_error", errors.DeadlineError.code))
            yield b"data: [DONE]\n\n"
        finally:
            scope.cancel()


async def _with_first(first: Event, events: trio.MemoryReceiveChannel[Event]) -> AsyncIterator[Event]:
    yield first
    if first[0] == "text":
        async for event in events:
            yield event


async def _drain_soon(token: trio.lowlevel.TrioToken) -> None:
    """Let callbacks queued with ``run_sync_soon`` before now run first (they run in order)."""
    done = trio.Event()
    token.run_sync_soon(done.set)
    await done.wait()


async def _cancel_on_disconnect(request: Request, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client hangs up (its body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, ensure_ascii=False).encode() + b"\n\n"


def _error(status: int, message: str, kind: str, code: str | None = None) -> Response:
    return JSONResponse(schema.error_doc(message, kind, code), status_code=status)


def _timeout(deadline: float) -> Response:
    return _error(504, f"the request took longer than {deadline:g}s", "timeout_error", errors.DeadlineError.code)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method, the body caps) as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code in (404, 405) else "invalid_request_error"
    return _error(exc.status_code, str(exc.detail), kind)
