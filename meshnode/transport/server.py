"""Start and stop the grpc.aio server on the node's asyncio thread (transport/aiothread.py)."""

from __future__ import annotations

import grpc
import trio

from meshnode.errors import InputError
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.session.hop import channel_options
from meshnode.transport.aiothread import AioRun


def split_hostport(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError(f"--listen {listen!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


async def _start(servicer: pb_grpc.NodeServicer, listen: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=channel_options())
    pb_grpc.add_NodeServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as e:
        raise InputError(f"cannot listen on {listen}: {e}") from e
    await server.start()
    return server, port


async def serve_grpc(servicer: pb_grpc.NodeServicer, listen: str, *, aio: AioRun, grace: float = 2.0,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; the server lives on the loop ``aio`` runs coroutines on.

    Reports ``host:port`` (the real bound port, for port 0) through
    ``task_status.started`` only once the server accepts connections. On
    cancellation it stops the server with a bounded, shielded grace period.
    """
    host, _ = split_hostport(listen)
    server, port = await aio(_start, servicer, listen)
    try:
        task_status.started(f"{host}:{port}")
        await trio.sleep_forever()
    finally:
        with trio.move_on_after(grace + 1.0, shield=True):
            await aio(server.stop, grace)
