"""A user-space TCP forwarder that delays every chunk by a fixed time in each direction.

This kernel has no netem; a hop behind this proxy is a hop at ``delay`` seconds of one-way latency
(a round trip of ``2 * delay``), bandwidth untouched. It forwards bytes, so TLS between the hops
still pins the node behind it. Each direction is a reader that stamps chunks with their due time
and a writer that sends them at it, in order.

``python -m bench.delayproxy TARGET_HOST:PORT DELAY_MS`` prints ``listening on 127.0.0.1:PORT``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Iterator

import trio


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, delay: float) -> None:
    send, recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)

    async def read() -> None:
        async with send:
            while data := await src.receive_some(1 << 16):
                await send.send((trio.current_time() + delay, data))

    async def write() -> None:
        async with recv:
            async for due, data in recv:
                await trio.sleep_until(due)
                await dst.send_all(data)
        with _quiet():
            await dst.send_eof()

    async with trio.open_nursery() as n:
        n.start_soon(read)
        n.start_soon(write)


async def _handle(client: trio.SocketStream, host: str, port: int, delay: float) -> None:
    try:
        upstream = await trio.open_tcp_stream(host, port)
    except OSError:
        await client.aclose()
        return
    async with client, upstream:
        with _quiet():
            async with trio.open_nursery() as n:
                n.start_soon(_pump, client, upstream, delay)
                n.start_soon(_pump, upstream, client, delay)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """A connection that breaks or closes ends its own forwarding, nothing else."""
    try:
        yield
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def serve(target: str, delay: float, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    host, _, port = target.rpartition(":")
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    addr = listeners[0].socket.getsockname()
    task_status.started(f"127.0.0.1:{addr[1]}")

    async def handler(stream: trio.SocketStream) -> None:
        await _handle(stream, host, int(port), delay)

    await trio.serve_listeners(handler, listeners)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.delayproxy")
    ap.add_argument("target", help="HOST:PORT to forward to")
    ap.add_argument("delay_ms", type=float, help="one-way delay in milliseconds, each direction")
    ns = ap.parse_args(argv)

    async def run() -> None:
        async with trio.open_nursery() as n:
            addr = await n.start(serve, ns.target, ns.delay_ms / 1000)
            print(f"listening on {addr}", flush=True)

    trio.run(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
