"""Start and stop the grpc.aio server on the node's asyncio thread (transport/aiothread.py)."""

from __future__ import annotations

import errno
import socket

import grpc
import trio

from meshnode.errors import InputError
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport import security
from meshnode.transport.aiothread import AioRun
from meshnode.transport.security import channel_options


def split_hostport(text: str, flag: str = "--listen") -> tuple[str, int]:
    """HOST:PORT (or [V6]:PORT) -> (host, port); InputError naming ``flag`` otherwise.

    A port is required: grpc would quietly take 443 for a bare host.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError(f"{flag} {text!r} is not HOST:PORT (a port is required)")
    return host.strip("[]"), int(port)


def check_listen(listen: str) -> None:
    """InputError now, before a node spends seconds loading, if ``listen`` cannot be bound.

    Binds and closes a plain socket with SO_REUSEADDR, as grpc's own bind does;
    the server's bind later is still checked (a port taken in between).
    """
    host, port = split_hostport(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InputError(f"cannot listen on {listen}: {e.strerror}") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            hint = ": another process holds the port; pick another --listen" if e.errno == errno.EADDRINUSE else ""
            raise InputError(f"cannot listen on {listen}: {e.strerror}{hint}") from e


async def _start(servicer: pb_grpc.NodeServicer, listen: str,
                 tls: tuple[bytes, bytes] | None) -> tuple[grpc.aio.Server, int]:
    # no SO_REUSEPORT (grpc's default on Linux): with it a second node on the same port would
    # bind too, and the kernel would split connections between the two
    server = grpc.aio.server(options=[*channel_options(), ("grpc.so_reuseport", 0)])
    pb_grpc.add_NodeServicer_to_server(servicer, server)
    try:
        port = security.add_port(server, listen, *(tls or (None, None)))
    except RuntimeError as e:
        raise InputError(f"cannot listen on {listen}: {e}") from e
    await server.start()
    return server, port


async def serve_grpc(servicer: pb_grpc.NodeServicer, listen: str, *, aio: AioRun, grace: float = 2.0,
                     tls: tuple[bytes, bytes] | None = None,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; the server lives on the loop ``aio`` runs coroutines on.

    ``tls``: the node's (key, certificate) PEM (identity/tlscert.py); None only under ``--insecure``.
    Reports ``host:port`` (the real bound port, for port 0) through
    ``task_status.started`` only once the server accepts connections. On
    cancellation it stops the server with a bounded, shielded grace period.
    """
    host, _ = split_hostport(listen)
    server, port = await aio(_start, servicer, listen, tls)
    try:
        task_status.started(f"{host}:{port}")
        await trio.sleep_forever()
    finally:
        with trio.move_on_after(grace + 1.0, shield=True):
            await aio(server.stop, grace)
