"""Serving meshnode's HTTP surfaces: ASGI apps under hypercorn's trio worker.

The protocol is the libraries': h11 (inside hypercorn) parses requests and
answers malformed ones itself (a bad ``Content-Length``, chunked garbage, a
TLS ClientHello on the plain port: 400 and close; a head still incomplete
past ``ServeLimits.max_head``: 431), hypercorn bounds idle and slow connections,
starlette gives the apps requests and responses. Our code does the meaning:
routes, JSON, and the body caps each route needs (``read_body``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshnode import errors
from meshnode.http.tls import TLSFiles

log = logging.getLogger("meshnode.http")
# hypercorn announces each bind as "Running on ... (CTRL + C to quit)"; our services print their own line
log.addFilter(lambda record: not record.getMessage().startswith("Running on"))

#: every response of ours: what a browser or proxy caches would be stale at once (live status)
NO_STORE = {"Cache-Control": "no-store"}


@dataclass(frozen=True)
class ServeLimits:
    #: bytes of a still incomplete request head h11 buffers; past them it answers 431 and closes
    max_head: int = 16 * 1024
    #: seconds an idle connection stays open, and the most a request head may take to arrive
    keep_alive: float = 5.0
    #: seconds a read may wait for more bytes before the connection is closed, whenever it is: also
    #: while the app works on a request (whole seconds, as hypercorn's Config types it). None: no
    #: such bound -- for the API, whose answers may take minutes; a head still arriving is bounded
    #: by ``keep_alive`` all the same (hypercorn's idle timer runs until a request's head is complete)
    read_timeout: int | None = 10
    #: seconds connections still open get when the server stops gracefully
    graceful: float = 2.0


def hypercorn_config(host: str, port: int, limits: ServeLimits, tls: TLSFiles | None = None) -> Config:
    """A hypercorn Config for one listener with ``limits``: HTTPS with ``tls``, else plain HTTP."""
    config = Config()
    if tls is not None:
        config.certfile, config.keyfile = str(tls.cert), str(tls.key)
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.h11_max_incomplete_size = limits.max_head
    config.keep_alive_timeout = limits.keep_alive
    config.read_timeout = limits.read_timeout
    config.graceful_timeout = limits.graceful
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = log
    return config


async def serve_asgi(app: Any, host: str, port: int, *, limits: ServeLimits = ServeLimits(),
                     tls: TLSFiles | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``host:port`` until cancelled; reports the bound port once it listens.

    Cancellation stops it at once: hypercorn's ``serve`` installs no signal
    handlers and its tasks live in its own nurseries, so cancelling the
    caller's scope closes the listener and every connection (no shutdown
    trigger needed). InputError if the address cannot be bound (in use, not
    this machine's).
    """
    config = hypercorn_config(host, port, limits, tls)
    listening = False
    try:
        async with trio.open_nursery() as nursery:
            # hypercorn reports its binds ("http://127.0.0.1:PORT") once its sockets listen
            binds: list[str] = await nursery.start(functools.partial(serve, app, config, mode="asgi"))
            listening = True
            task_status.started(int(binds[0].rsplit(":", 1)[1]))
    except (OSError, BaseExceptionGroup) as e:
        bind_error = None if listening else _os_error(e)
        if bind_error is None:
            raise
        raise errors.InputError(f"cannot listen on {host}:{port}: {bind_error.strerror or bind_error}") from e


def _os_error(e: BaseException) -> OSError | None:
    """The OSError ``e`` is or carries (hypercorn's nurseries wrap it in groups), if any."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, BaseExceptionGroup):
        return next((found for sub in e.exceptions if (found := _os_error(sub)) is not None), None)
    return None


def json_response(doc: Any, status: int = 200) -> Response:
    """``doc`` as JSON (``json.dumps``' default spacing, as meshnode always sent it), never cached."""
    return Response(json.dumps(doc).encode(), status, headers=NO_STORE, media_type="application/json")


def error_response(status: int, code: str, message: str) -> Response:
    return json_response({"error": code, "message": message}, status)


async def read_body(request: Request, limit: int, timeout: float = 10.0) -> bytes:
    """The request's body, at most ``limit`` bytes, all of it within ``timeout`` seconds.

    HTTPException 413 for a longer body (refused by its Content-Length before
    anything is read, or as soon as a chunked body passes the limit), 408 if it
    is not all there in time, 400 if the client went away.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:  # h11 checked its syntax
        raise HTTPException(413, f"request body of {declared} bytes is over the {limit}-byte limit")
    body = bytearray()
    try:
        with trio.fail_after(timeout):
            async with contextlib.aclosing(request.stream()) as chunks:  # closed at once when refused
                async for chunk in chunks:
                    body += chunk
                    if len(body) > limit:
                        raise HTTPException(413, f"request body is over the {limit}-byte limit")
    except trio.TooSlowError:
        raise HTTPException(408, f"request body not received within {timeout:g}s") from None
    except ClientDisconnect:
        raise HTTPException(400, "the client went away before its body was complete") from None
    return bytes(body)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's HTTP errors (no route, wrong method, body caps) as meshnode's JSON errors."""
    assert isinstance(exc, HTTPException)
    if exc.status_code in (404, 405):  # meshnode never told the two apart: 404 for both
        return error_response(404, "NOT_FOUND", f"no route {request.method} {request.url.path}")
    return error_response(exc.status_code, "INVALID_ARGUMENT", exc.detail)


def asgi_app(routes: Sequence[BaseRoute]) -> ASGIApp:
    """A starlette app of ``routes`` whose errors are meshnode's JSON errors."""
    app = Starlette(routes=list(routes), exception_handlers={HTTPException: _http_error})

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_or_drop(message: Message) -> None:
            try:
                await send(message)
            except trio.BusyResourceError:
                # hypercorn's trio worker half-closes a connection whose request h11 refused (send_eof,
                # outside its send lock) while the app may still be answering it: that send collides.
                # The client broke the protocol and the connection is closing: drop the rest of the answer.
                pass

        await app(scope, receive, send_or_drop)

    return guarded
