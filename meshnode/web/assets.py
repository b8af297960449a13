"""Serving the pages and their assets, and the headers that make them safe.

``asset_mount()`` serves ``static/`` under ``/assets`` (starlette's
StaticFiles: ETag, ranges, no directory listing, no path outside the folder);
``page(name)`` answers one of the HTML pages; ``secure(app)`` wraps an ASGI
app so that every response carries the Content-Security-Policy and its
companions. The policy allows scripts, styles, images and fetches from the
page's own origin only: no inline script (the pages have none), no CDN, no
framing, no form posts, no plugins. uPlot and the pages set styles through
the CSSOM (``element.style``), which the policy allows without
``'unsafe-inline'``.
"""

from __future__ import annotations

from pathlib import Path

from starlette.responses import FileResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC = Path(__file__).parent / "static"

#: the pages' policy: their own origin for everything, nothing inline, no framing
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'")
#: sent with every response of an app wrapped by ``secure``
HEADERS = ((b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
           (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"))


def asset_mount(path: str = "/assets") -> Mount:
    """``static/`` served read-only under ``path``."""
    return Mount(path, app=StaticFiles(directory=STATIC), name="assets")


def page(name: str) -> Response:
    """The HTML page ``static/NAME`` (revalidated on every load: a node's upgrade shows at once)."""
    return FileResponse(STATIC / name, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})


def secure(app: ASGIApp) -> ASGIApp:
    """``app`` with the security headers on every HTTP response (ones it set itself are replaced)."""
    names = {name for name, _ in HEADERS}

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": kept + list(HEADERS)}
            await send(message)

        await app(scope, receive, send_secured)

    return wrapped
