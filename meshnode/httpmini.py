"""A small HTTP/1.1 server and client on trio streams (one request per connection).

Enough for the tracker's JSON API and status page and for nodes talking to
it: request line, headers, a Content-Length body, bounded sizes and
timeouts; ``Connection: close`` on every response. No chunked encoding, no
keep-alive, no TLS.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from meshnode import errors

MAX_HEAD = 16 * 1024
MAX_BODY = 4 * 1024 * 1024
REQUEST_TIMEOUT = 10.0


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, doc: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(doc).encode())


Handler = Callable[[Request], Awaitable[Response]]
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
           413: "Payload Too Large", 500: "Internal Server Error"}


async def _read_request(stream: trio.abc.Stream) -> Request | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > MAX_HEAD:
            raise errors.InputError("request head too large")
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        raise errors.InputError("malformed request line") from None
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0") or 0)
    if length > MAX_BODY:
        raise errors.InputError("request body too large")
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise errors.InputError("request body cut short")
        rest += chunk
    url = urllib.parse.urlsplit(target)
    query = dict(urllib.parse.parse_qsl(url.query))
    return Request(method.upper(), url.path, query, headers, rest[:length])


async def _write_response(stream: trio.abc.Stream, resp: Response) -> None:
    head = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'Status')}",
            f"Content-Type: {resp.content_type}", f"Content-Length: {len(resp.body)}", "Connection: close",
            "Cache-Control: no-store", *[f"{k}: {v}" for k, v in resp.headers.items()]]
    await stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode() + resp.body)


async def serve_http(handler: Handler, host: str, port: int, *,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; reports the bound port once listening."""
    listeners = await trio.open_tcp_listeners(port, host=host)

    async def one(stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(REQUEST_TIMEOUT):
                try:
                    req = await _read_request(stream)
                    if req is None:
                        return
                    resp = await handler(req)
                except errors.MeshnodeError as e:
                    resp = Response.json({"error": e.code, "message": e.message}, 400)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                try:
                    await _write_response(stream, resp)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(one, listeners)


async def request(url: str, method: str = "GET", body: bytes = b"", *, content_type: str = "application/json",
                  timeout: float = 10.0) -> tuple[int, bytes]:
    """One HTTP request; (status, body). PeerError if the server cannot be reached."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname:
        raise errors.InputError(f"{url!r} is not an http:// URL")
    target = u.path or "/"
    if u.query:
        target += "?" + u.query
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(u.hostname, u.port or 80)
            async with stream:
                head = (f"{method} {target} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: {content_type}\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
                await stream.send_all(head.encode() + body)
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as e:
        raise errors.PeerError(f"tracker {url} unreachable: {e!r}", hop=u.netloc) from e
    head_b, _, payload = data.partition(b"\r\n\r\n")
    try:
        status = int(head_b.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise errors.PeerError(f"tracker {url} sent a malformed response", hop=u.netloc) from None
    return status, payload
