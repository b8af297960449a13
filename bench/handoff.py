"""Where should llama.cpp run: a worker thread, or a supervised child process?

Measures the per-step overhead of handing 3 ms of work (about one hop's
decode step on SmolLM2) to a worker thread vs to a child process, awaited
from the node's kind of event loop (a plain asyncio loop on its own thread,
meshnode/transport/aiothread.py), on this machine. (A node runs single-token
decode steps inline on that loop's thread and hands only prompt chunks to
the worker thread: docs/architecture.md, "executor placement".)

    python -m bench.handoff
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import multiprocessing as mp
import statistics
import struct
import time
from multiprocessing.connection import Connection

import trio

from meshnode.transport.aiothread import open_aio_thread

WORK = 0.003
N = 300


_BUF = bytes(1 << 20)
_REPS = 1


def work() -> float:
    """~WORK seconds of native work that releases the GIL, as llama_decode does; returns its duration."""
    t = time.perf_counter()
    for _ in range(_REPS):
        hashlib.sha256(_BUF).digest()
    return time.perf_counter() - t


def calibrate() -> None:
    global _REPS
    t = time.perf_counter()
    for _ in range(20):
        hashlib.sha256(_BUF).digest()
    _REPS = max(1, round(WORK / ((time.perf_counter() - t) / 20)))


def child(conn: Connection) -> None:
    while True:
        x = conn.recv_bytes()
        if not x:
            return
        if x[:1] == b"C":
            calibrate()
            continue
        conn.send_bytes(struct.pack("d", work()))


async def thread_handoff() -> float:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    ts = []
    for _ in range(N):
        t = time.perf_counter()
        spent = await asyncio.wrap_future(pool.submit(work))
        ts.append(time.perf_counter() - t - spent)
    pool.shutdown()
    return statistics.median(ts)


async def process_handoff(conn: Connection) -> float:
    loop = asyncio.get_running_loop()
    payload = bytes(576 * 4)
    ts = []
    for _ in range(N):
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(conn.fileno(), lambda f=fut: f.done() or f.set_result(None))
        t = time.perf_counter()
        conn.send_bytes(payload)
        await fut
        loop.remove_reader(conn.fileno())
        (spent,) = struct.unpack("d", conn.recv_bytes())
        ts.append(time.perf_counter() - t - spent)
    return statistics.median(ts)


def main() -> None:
    calibrate()
    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=child, args=(b,))
    p.start()
    a.send_bytes(b"C")

    async def run() -> tuple[float, float]:
        async with open_aio_thread() as aio:
            th = await aio.run(thread_handoff)
            pr = await aio.run(process_handoff, a)
            return th, pr

    th, pr = trio.run(run)
    a.send_bytes(b"")
    p.join()
    print(f"worker thread  (asyncio data-plane loop): {th * 1e3:.3f} ms per step")
    print(f"child process  (asyncio data-plane loop): {pr * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
