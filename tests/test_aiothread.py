"""The node's asyncio data-plane thread, driven from trio (meshnode/transport/aiothread.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from meshnode.transport.aiothread import open_aio_thread


async def test_run_and_call_execute_on_the_loop_thread() -> None:
    async def where() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    with trio.fail_after(10):
        async with open_aio_thread(name="dp-test") as aio:
            assert await aio.run(where) == "dp-test"
            assert await aio.call(lambda: threading.current_thread().name) == "dp-test"
            assert threading.current_thread().name != "dp-test"


async def test_errors_cross_back_to_trio() -> None:
    async def boom() -> None:
        raise KeyError("from asyncio")

    def sync_boom() -> None:
        raise ValueError("from the loop thread")

    with trio.fail_after(10):
        async with open_aio_thread() as aio:
            with pytest.raises(KeyError):
                await aio.run(boom)
            with pytest.raises(ValueError, match="loop thread"):
                await aio.call(sync_boom)
            assert await aio.run(asyncio.sleep, 0, "still serving") == "still serving"


async def test_trio_cancellation_cancels_the_asyncio_task_and_waits_for_its_cleanup() -> None:
    events: list[str] = []

    async def long_job() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # clean-up that itself awaits
            events.append("cleaned up")
            raise

    with trio.fail_after(10):
        async with open_aio_thread() as aio:
            with trio.move_on_after(0.2) as scope:
                await aio.run(long_job)
            assert scope.cancelled_caught
            assert events == ["cleaned up"]  # finished before run() gave control back


async def test_exit_cancels_leftover_tasks_and_joins_the_thread() -> None:
    ended = threading.Event()
    threads_before = set(threading.enumerate())
    leftover: list[asyncio.Future[None]] = []

    async def start_forever() -> None:
        async def forever() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                ended.set()

        leftover.append(asyncio.ensure_future(forever()))

    with trio.fail_after(20):
        async with open_aio_thread(name="dp-leftover") as aio:
            await aio.run(start_forever)
    assert ended.is_set()
    assert not [t for t in threading.enumerate() if t not in threads_before and t.name == "dp-leftover"]


def test_meshnode_programs_never_import_trio_asyncio() -> None:
    """trio-asyncio monkeypatches asyncio process-wide on import (its get_running_loop asks trio first),
    which made every asyncio step of a node's data plane several times slower (docs/architecture.md)."""
    import subprocess
    import sys

    code = ("import sys, meshnode.cli.main, meshnode.node, meshnode.cli.membership, meshnode.cli.demo, "
            "meshnode.session.mesh, meshnode.discovery.mdns; sys.exit('trio_asyncio' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
