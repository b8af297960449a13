"""TLS on every node stream, pinned to node ids (transport/security.py, identity/tlscert.py).

Real nodes (separate processes) and, between them, relays this test runs itself on
loopback: one that only forwards bytes (an on-path observer) and one that terminates
TLS with a certificate of its own and forwards to the real node (a man in the middle).
"""

from __future__ import annotations

import contextlib
import functools
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from meshnode import errors
from meshnode.identity import NodeIdentity, tlscert
from meshnode.session.initiator import GenerateConfig, RouteSession, check_route
from meshnode.transport import security
from meshnode.transport.client import get_capability
from tests.conftest import aio, cli

PROMPT = "The capital of France is"


async def _certificate(endpoint: str) -> tuple[bytes, str]:
    return await security.peer_certificate(endpoint)


class Relay:
    """Forwards every connection to ``target``, keeping a copy of the bytes it saw.

    With ``impersonate`` (a key and certificate PEM) it terminates TLS itself with that
    certificate and opens its own TLS connection to the target: a man in the middle.
    """

    def __init__(self, target: str, impersonate: tuple[Path, Path] | None = None) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.seen = bytearray()
        self.server_ctx: ssl.SSLContext | None = None
        if impersonate is not None:
            self.server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.server_ctx.load_cert_chain(certfile=impersonate[1], keyfile=impersonate[0])
            self.server_ctx.set_alpn_protocols(["h2"])
        self.endpoint = ""

    async def _pump(self, src: trio.abc.Stream, dst: trio.abc.Stream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            while data := await src.receive_some(1 << 16):
                self.seen += data
                await dst.send_all(data)
        with contextlib.suppress(Exception):
            await trio.aclose_forcefully(dst)

    async def _handle(self, down: trio.abc.Stream) -> None:
        up: trio.abc.Stream | None = None
        try:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                if self.server_ctx is not None:
                    down = trio.SSLStream(down, self.server_ctx, server_side=True)
                    await down.do_handshake()
                up = await trio.open_tcp_stream(*self.target)
                if self.server_ctx is not None:
                    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
                    ctx.set_alpn_protocols(["h2"])
                    up = trio.SSLStream(up, ctx, server_hostname=tlscert.TLS_NAME)
                    await up.do_handshake()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, down, up)
                    nursery.start_soon(self._pump, up, down)
        finally:
            with trio.CancelScope(shield=True):  # the relay being cancelled must not skip a close
                for stream in (down, up):
                    if stream is not None:
                        with contextlib.suppress(Exception):  # a broken TLS stream may complain as it goes
                            await trio.aclose_forcefully(stream)


@contextlib.asynccontextmanager
async def relay(target: str, impersonate: tuple[Path, Path] | None = None) -> AsyncIterator[Relay]:
    r = Relay(target, impersonate)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, r._handle, 0, host="127.0.0.1"))
        r.endpoint = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield r
        nursery.cancel_scope.cancel()


def _generate(*args: str) -> dict[str, object] | str:
    proc = cli("generate", *args, "--prompt", PROMPT, "--max-tokens", "8", "--json")
    return json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr


def _peers(*endpoints: str) -> list[str]:
    return [a for e in endpoints for a in ("--peer", e)]


async def test_a_node_speaks_tls13_with_a_certificate_bound_to_its_node_id(route2):
    head = route2[0]
    der, version = await aio(_certificate, head.endpoint)
    assert version == "TLSv1.3"
    cap = await aio(get_capability, head.endpoint)
    assert tlscert.bound_node_id(der) == cap.node_id
    assert not cap.insecure
    # the certificate it presents is the one kept in its state dir (the same after a restart)
    assert head.state_dir is not None
    assert ssl.PEM_cert_to_DER_cert((head.state_dir / tlscert.CERT_FILE).read_text()) == der
    assert (head.state_dir / tlscert.KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_a_certificate_binding_cannot_be_moved_to_another_key():
    """The binding signs the certificate's own key: another certificate cannot carry it."""
    ident = NodeIdentity.generate()
    _, cert = tlscert.make(ident)
    assert tlscert.bound_node_id(cert) == ident.node_id
    _, other = tlscert.make(NodeIdentity.generate())
    from cryptography import x509

    stolen = x509.load_pem_x509_certificate(cert).extensions.get_extension_for_oid(tlscert.BINDING_OID).value
    forged = x509.load_pem_x509_certificate(other)
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    b = (x509.CertificateBuilder().subject_name(forged.subject).issuer_name(forged.issuer)
         .public_key(key.public_key()).serial_number(1)
         .not_valid_before(forged.not_valid_before_utc).not_valid_after(forged.not_valid_after_utc)
         .add_extension(stolen, critical=False).sign(key, hashes.SHA256()))
    with pytest.raises(errors.TransportSecurityError, match="not signed by the identity"):
        tlscert.bound_node_id(b.public_bytes(serialization.Encoding.PEM))
    plain = (x509.CertificateBuilder().subject_name(forged.subject).issuer_name(forged.issuer)
             .public_key(key.public_key()).serial_number(2)
             .not_valid_before(forged.not_valid_before_utc).not_valid_after(forged.not_valid_after_utc)
             .sign(key, hashes.SHA256()))
    with pytest.raises(errors.TransportSecurityError, match="not bound"):
        tlscert.bound_node_id(plain.public_bytes(serialization.Encoding.PEM))


async def test_an_on_path_relay_sees_ciphertext_and_under_insecure_the_prompt(route2, node_factory):
    head, tail = route2
    direct = await trio.to_thread.run_sync(_generate, *_peers(head.endpoint, tail.endpoint))
    assert isinstance(direct, dict), direct
    async with relay(tail.endpoint) as r:  # the tokenizer's request and every residual pass it
        through = await trio.to_thread.run_sync(_generate, *_peers(head.endpoint, r.endpoint))
    assert isinstance(through, dict), through
    assert through["tokens"] == direct["tokens"]
    assert len(r.seen) > 8 * 2304  # eight residuals went by...
    assert b"France" not in r.seen  # ...and neither the prompt's text
    assert b"SmolLM2" not in r.seen  # nor the capability's model name

    # the same relay in front of nodes started with --insecure reads the prompt as it goes by
    ihead = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=("--insecure",)))
    itail = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=("--insecure",)))
    async with relay(itail.endpoint) as r:
        plain = await trio.to_thread.run_sync(_generate, "--insecure", *_peers(ihead.endpoint, r.endpoint))
    assert isinstance(plain, dict), plain
    assert plain["tokens"] == direct["tokens"]
    assert b"France" in r.seen
    assert "--insecure" in itail.stderr()
    assert "plaintext" in itail.stderr()
    cap = await aio(_insecure_capability, itail.endpoint)
    assert cap.insecure
    # a client that expects TLS refuses a plaintext node, and says why
    refused = await trio.to_thread.run_sync(_generate, *_peers(ihead.endpoint, itail.endpoint))
    assert isinstance(refused, str)
    assert "TRANSPORT_INSECURE" in refused
    assert "--insecure" in refused


async def _insecure_capability(endpoint: str):  # type: ignore[no-untyped-def]
    security.configure(insecure=True)
    try:
        return await get_capability(endpoint)
    finally:
        security.SETTINGS.insecure = False


async def test_a_man_in_the_middle_that_terminates_tls_is_refused(route2, tmp_path):
    head, tail = route2
    key, cert = tlscert.make(NodeIdentity.generate())  # the best it can do: a certificate of its own
    (tmp_path / "k.pem").write_bytes(key)
    (tmp_path / "c.pem").write_bytes(cert)
    tail_id = (await aio(get_capability, tail.endpoint)).node_id
    async with relay(tail.endpoint, impersonate=(tmp_path / "k.pem", tmp_path / "c.pem")) as mitm:
        # a client that knows whom it meant to reach
        with pytest.raises(errors.ImpostorError, match=tail_id):
            await aio(get_capability, mitm.endpoint, 5.0, tail_id)
        # one that does not (--peer HOST:PORT): the capability it relays is signed by another node than
        # the certificate's
        with pytest.raises(errors.ImpostorError, match="capability claims"):
            await aio(get_capability, mitm.endpoint)
        out = await trio.to_thread.run_sync(_generate, *_peers(head.endpoint, mitm.endpoint))
    assert isinstance(out, str)
    assert "PEER_IMPOSTOR" in out


async def test_an_impostor_on_a_known_nodes_endpoint_is_refused(node_factory):
    head = await trio.to_thread.run_sync(node_factory, "0:15")
    tail = await trio.to_thread.run_sync(node_factory, "15:30")
    peers = [head.endpoint, tail.endpoint]
    caps = await aio(check_route, peers)
    port = tail.endpoint.rpartition(":")[2]
    await trio.to_thread.run_sync(tail.stop)
    impostor = await trio.to_thread.run_sync(
        lambda: node_factory("15:30", extra=("--listen", f"127.0.0.1:{port}")))  # another key, the same address
    assert impostor.endpoint == tail.endpoint

    with pytest.raises(errors.ImpostorError, match=caps[1].node_id):
        await aio(get_capability, tail.endpoint, 5.0, caps[1].node_id)

    async def open_route() -> None:
        security.forget(tail.endpoint)  # this process's own pin of the old tail would refuse it first
        rs = RouteSession(peers, caps, GenerateConfig(prompt="", max_tokens=1), NodeIdentity.generate())
        try:
            await rs.open()
        finally:
            await rs.close()

    # the head connects to the next hop the signed open names, and refuses whoever else answers there
    with pytest.raises(errors.ImpostorError) as caught:
        await aio(open_route)
    assert caught.value.hop is not None
