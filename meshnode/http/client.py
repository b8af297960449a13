"""meshnode's HTTP client side (tracker registrations, lookups, status): httpx on trio.

One request per call, its answer streamed and capped, the whole of it under
one deadline; every failure of the server (unreachable, too slow, broken
framing, an answer over the cap) is a ``PeerError`` naming it, translated
here and nowhere else.
"""

from __future__ import annotations

import functools
import urllib.parse
from typing import TYPE_CHECKING

import trio

from meshnode import errors

if TYPE_CHECKING:
    import ssl

    import httpx

#: bytes an answer may carry; a tracker's status of thousands of nodes fits many times over
MAX_ANSWER = 4 * 1024 * 1024


async def request(url: str, method: str = "GET", body: bytes = b"", *, content_type: str = "application/json",
                  timeout: float = 10.0, max_answer: int = MAX_ANSWER) -> tuple[int, bytes]:
    """One HTTP request to a tracker: (status, body).

    InputError for a URL that is not http(s)://HOST; PeerError if the tracker
    cannot be reached, breaks the protocol, sends more than ``max_answer``
    bytes or takes longer than ``timeout`` seconds for all of it.
    Cancellation closes the connection.
    """
    import httpx  # ~3 MB and ~0.15 s of imports: paid only by programs that talk to a tracker

    from meshnode.http import tls as httptls

    host = _check_url(url)
    pin = httptls.pin_of(url)
    url = urllib.parse.urldefrag(url).url
    headers = {"Content-Type": content_type, "Accept-Encoding": "identity"}  # the cap counts what arrives
    try:
        with trio.fail_after(timeout):
            u = urllib.parse.urlsplit(url)
            verify = _tls() if pin is None else await httptls.pinned_context(u.hostname or "", u.port or 443, pin,
                                                                            timeout)
            # trust_env=False: a mesh's tracker is reached directly, never through an HTTP(S)_PROXY of the user's
            async with httpx.AsyncClient(timeout=timeout, trust_env=False, verify=verify) as client:
                async with client.stream(method, url, content=body, headers=headers) as resp:
                    return resp.status_code, await _read_capped(resp, url, host, max_answer)
    except trio.TooSlowError:
        raise errors.PeerError(f"tracker {url} did not answer within {timeout:g}s", hop=host) from None
    except httpx.HTTPError as e:
        raise errors.PeerError(f"tracker {url} unreachable: {_why(e)}", hop=host) from e


def _why(e: BaseException) -> str:
    """What went wrong, from the deepest cause that says: httpx's ConnectError over a failed TLS handshake
    carries an empty message of its own."""
    import ssl

    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return (f"its certificate did not verify ({seen.verify_message}): a tracker with a self-signed "
                    "certificate is reached by its pin, URL#sha256=FINGERPRINT as the tracker printed it")
        if isinstance(seen, ssl.SSLError):
            return f"TLS handshake failed ({seen.reason or seen})"
        seen = seen.__cause__ or seen.__context__
    return str(e) or repr(e)


async def _read_capped(resp: httpx.Response, url: str, host: str, limit: int) -> bytes:
    import httpx

    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise errors.PeerError(f"tracker {url} answered {declared} bytes, over the {limit}-byte limit", hop=host)
    data = bytearray()
    try:
        async for chunk in resp.aiter_raw():
            data += chunk
            if len(data) > limit:
                # close the connection and let the stream end (ReadError) instead of leaving the loop:
                # httpx's stream generators left suspended are reported by trio (encode/httpx#3686)
                await resp.aclose()
    except httpx.ReadError:
        if len(data) <= limit:
            raise
    if len(data) > limit:
        raise errors.PeerError(f"tracker {url} answered more than {limit} bytes", hop=host)
    return bytes(data)


@functools.cache
def _tls() -> ssl.SSLContext:
    """One verifying TLS context (httpx's default, certifi's CAs) for every request: a client built
    without one builds its own, reading the CA bundle (~35 ms a request on this machine kind)."""
    import httpx

    return httpx.create_ssl_context(trust_env=False)


def tracker_url(base: str, path: str) -> str:
    """``base`` (a tracker's URL, perhaps with a ``#sha256=`` pin) with ``path`` (and query) appended; the pin
    stays the URL's fragment."""
    url, frag = urllib.parse.urldefrag(base)
    return url.rstrip("/") + path + (f"#{frag}" if frag else "")


def _check_url(url: str) -> str:
    """The URL's HOST:PORT; InputError unless it is an http:// or https:// URL with a host."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise errors.InputError(f"{url!r} is not an http:// URL")
    return u.netloc
