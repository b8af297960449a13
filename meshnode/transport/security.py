"""TLS 1.3 on every node stream, pinned to the node id the caller means to reach.

No certificate authority and no trust on first use: a node's certificate is
bound to its Ed25519 identity (``identity/tlscert.py``). Before a channel
opens, the client reads the certificate the endpoint presents (one TLS 1.3
handshake), checks that its binding verifies and names the node id the caller
expects, then opens the grpc channel with exactly that certificate as the one
root it trusts. So:

* an impostor on a known node's endpoint (its own key) presents another node
  id: ``ImpostorError``, before a byte of the session is sent;
* a man in the middle that terminates TLS cannot present a certificate bound to
  the real node (it lacks that node's Ed25519 key), and cannot complete a
  handshake with the real node's certificate (it lacks its TLS key):
  ``TransportSecurityError`` or ``ImpostorError``;
* a relay that only forwards bytes sees TLS records, nothing else.

A caller that knows no node id yet (``--peer HOST:PORT``) learns it from the
certificate; the capability read over that channel must be signed by the same
id (``client.get_capability``), and every later channel names that id. ``--insecure`` turns all of this off for a closed
lab network: plaintext both ways, said in the logs and on the tracker's page.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from meshnode import errors
from meshnode.identity.tlscert import TLS_NAME, bound_node_id

log = logging.getLogger("meshnode.security")

#: seconds the certificate check may take (one TCP connect and one TLS handshake)
PIN_TIMEOUT = 5.0


@dataclass
class _Settings:
    insecure: bool = False


SETTINGS = _Settings()
#: endpoint -> (node id, certificate PEM) checked in this process
_pins: dict[str, tuple[str, bytes]] = {}


def configure(*, insecure: bool) -> None:
    """Process-wide: plaintext streams (``--insecure``) or TLS pinned to node ids (the default)."""
    SETTINGS.insecure = insecure
    if insecure:
        log.warning("--insecure: node streams are plaintext and unauthenticated; anyone on the path reads the "
                    "prompt's token ids and every residual, and can answer in a node's place. Closed labs only.")


def insecure() -> bool:
    return SETTINGS.insecure


def forget(endpoint: str) -> None:
    """Drop what this process pinned for ``endpoint`` (its next channel checks the certificate again)."""
    _pins.pop(endpoint, None)


def pinned(endpoint: str) -> str | None:
    """The node id this process pinned ``endpoint`` to, if any."""
    hit = _pins.get(endpoint)
    return hit[0] if hit else None


def _split(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InputError(f"{endpoint!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the certificate is checked against the identity it names, below
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def peer_certificate(endpoint: str, timeout: float = PIN_TIMEOUT) -> tuple[bytes, str]:
    """The DER certificate ``endpoint`` presents in a TLS 1.3 handshake, and the TLS version agreed."""
    host, port = _split(endpoint)
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await loop.create_connection(asyncio.Protocol, host, port)
    except TimeoutError:
        raise errors.DeadlineError(f"no TCP connection within {timeout:.1f}s", hop=endpoint) from None
    except OSError as e:
        raise errors.PeerError(f"unreachable ({e.strerror or e})", hop=endpoint) from e
    try:  # connected: from here on, whatever goes wrong is the TLS handshake's
        async with asyncio.timeout(timeout):
            tls = await loop.start_tls(transport, transport.get_protocol(), _client_context(),
                                       server_hostname=TLS_NAME, ssl_handshake_timeout=timeout)
    except (TimeoutError, ssl.SSLError, OSError, EOFError) as e:
        transport.abort()
        why = "no answer" if isinstance(e, TimeoutError) else (getattr(e, "reason", None) or repr(e))
        raise errors.TransportSecurityError(
            f"did not complete a TLS 1.3 handshake ({why}): not a meshnode, or one started with --insecure "
            "(plaintext; pass --insecure here too, on a closed network only)", hop=endpoint) from e
    if tls is None:
        transport.abort()
        raise errors.TransportSecurityError("closed the connection during the TLS handshake", hop=endpoint)
    try:
        sslobj = tls.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        version = sslobj.version() if sslobj is not None else None
    finally:
        tls.abort()  # nothing more to say: the certificate was all it was asked for
    if not der:
        raise errors.TransportSecurityError("presented no certificate", hop=endpoint)
    return der, version or ""


async def pin(endpoint: str, node_id: str | None = None) -> tuple[str, bytes]:
    """(node id, certificate PEM) of ``endpoint``, checked: ImpostorError if it is not ``node_id``.

    With a ``node_id``, what this process already checked for the endpoint serves again; without
    one the caller expects nobody in particular, so the certificate is read afresh (another node
    may hold the endpoint now) and the pin follows it.
    """
    hit = _pins.get(endpoint)
    if hit is not None and node_id is not None and hit[0] == node_id:
        return hit
    der, _ = await peer_certificate(endpoint)
    try:
        found = bound_node_id(der)
    except errors.TransportSecurityError as e:
        e.hop = endpoint
        raise
    if node_id is not None and found != node_id:
        raise errors.ImpostorError(f"presents node {found}, not {node_id}: refused (another key holds this "
                                   "endpoint: an impostor, or the node was replaced)", hop=endpoint)
    entry = (found, ssl.DER_cert_to_PEM_cert(der).encode())
    _pins[endpoint] = entry
    return entry


def channel_options() -> list[tuple[str, int | str]]:
    # bundles are bounded by max_prefill_chunk_tokens x n_embd x 4 bytes (+ logits
    # when asked): 64 MiB leaves room for wide models without being unbounded
    return [
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.max_receive_message_length", 64 << 20),
    ]


async def open_channel(endpoint: str, node_id: str | None = None,
                       options: Sequence[tuple[str, int | str]] = (), *,
                       plaintext: bool | None = None) -> grpc.aio.Channel:
    """The one way meshnode opens a channel to another node (initiator and hops alike).

    ``options``: grpc channel arguments over meshnode's own (a test's own subchannel pool, say).
    ``plaintext``: this call's choice over the process's (the tracker probes each node as its signed
    capability says it serves; None: ``--insecure`` or not).
    """
    opts = {**dict(channel_options()), **dict(options)}
    if SETTINGS.insecure if plaintext is None else plaintext:
        return grpc.aio.insecure_channel(endpoint, options=list(opts.items()))
    _, pem = await pin(endpoint, node_id)
    opts["grpc.ssl_target_name_override"] = TLS_NAME
    return grpc.aio.secure_channel(endpoint, grpc.ssl_channel_credentials(root_certificates=pem),
                                   options=list(opts.items()))


def add_port(server: grpc.aio.Server, listen: str, key_pem: bytes | None, cert_pem: bytes | None) -> int:
    """Listen on ``listen``: TLS with the node's bound certificate, or plaintext under ``--insecure``."""
    if SETTINGS.insecure:
        return int(server.add_insecure_port(listen))
    if key_pem is None or cert_pem is None:
        raise errors.InputError("a TLS listener needs the node's certificate (identity/tlscert.py)")
    return int(server.add_secure_port(listen, grpc.ssl_server_credentials([(key_pem, cert_pem)])))
