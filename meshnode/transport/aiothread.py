"""A plain asyncio event loop on its own thread, owned by a trio task: the node's data plane.

grpc's asyncio API (grpc.aio) has no trio support. A node serves it on a
dedicated thread that runs an ordinary asyncio loop, and trio talks to that
loop only through ``AioThread.run`` / ``AioThread.call`` (habit 8 of
docs/STYLE: foreign threads reach trio through ``trio.from_thread`` with a
token, and trio reaches them through the loop's thread-safe entry points).

Why not trio-asyncio here (docs/architecture.md, "the bridge"): trio-asyncio
runs asyncio callbacks from trio's own scheduler, and every gRPC completion
crosses it; measured on this machine kind, a bidi-stream round trip between
two processes costs ~600 µs that way and ~175 µs on a plain asyncio loop.
A node's per-token path is several such completions per hop, so the data
plane gets a loop of its own, and trio keeps the node's lifecycle (signals,
nurseries, drain, discovery).

Lifetime: ``open_aio_thread`` is an async context manager; the loop runs for
exactly the body of the ``async with``. On exit the loop's remaining tasks
are cancelled and awaited, the loop is closed and the thread joined
(bounded, shielded). ``run`` propagates trio cancellation to the asyncio
task it started and waits (bounded) for that task to finish its clean-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import outcome
import trio

log = logging.getLogger("meshnode.aio")

T = TypeVar("T")

#: seconds trio waits for an asyncio task it cancelled to finish its clean-up
CANCEL_GRACE = 5.0
#: seconds the loop's leftover tasks get to finish when the thread stops
STOP_GRACE = 10.0


class AioThread:
    """Handle to the running loop; every method is called from trio."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` as a task on the loop and return its result (or raise its error).

        Cancelling the trio caller (or a KeyboardInterrupt delivered to it)
        cancels the asyncio task; the caller then waits up to ``CANCEL_GRACE``
        seconds (shielded) for the task to end, so the task's clean-up (a
        route's release, say) is not cut short by a process that moves on.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []
        tasks: list[asyncio.Task[None]] = []

        async def call() -> None:
            try:
                box.append(await outcome.acapture(fn, *args))
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(done.set)

        def start() -> None:
            tasks.append(self.loop.create_task(call()))

        def cancel() -> None:  # runs after start(): the loop runs callbacks in FIFO order
            if tasks:
                tasks[0].cancel()

        self.loop.call_soon_threadsafe(start)
        try:
            await done.wait()
        except BaseException:  # trio.Cancelled, or KeyboardInterrupt delivered here: end the task first
            self.loop.call_soon_threadsafe(cancel)
            with trio.move_on_after(CANCEL_GRACE, shield=True):
                await done.wait()
            raise
        if not box:  # cancelled on the loop's side before fn ran: the loop is stopping
            raise trio.ClosedResourceError("the asyncio data-plane loop stopped")
        return box[0].unwrap()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``fn(*args)`` on the loop's thread (for state the loop owns)."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def call() -> None:
            box.append(outcome.capture(fn, *args))
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        self.loop.call_soon_threadsafe(call)
        with trio.move_on_after(CANCEL_GRACE, shield=True):  # short by contract; not cancellable half-way
            await done.wait()
        if not box:
            raise trio.ClosedResourceError("the asyncio data-plane loop did not run the call")
        return box[0].unwrap()


def _log_loop_error(loop: object, context: dict[str, object]) -> None:
    """A stray error of one asyncio task is logged; it never ends the node."""
    exc = context.get("exception")
    log.error("asyncio: %s", context.get("message"), exc_info=exc if isinstance(exc, BaseException) else None)


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The thread's body: run the loop until stopped, then cancel and await what is left."""
    try:
        loop.run_forever()
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=STOP_GRACE))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


@contextlib.asynccontextmanager
async def open_aio_thread(name: str = "meshnode-aio") -> AsyncIterator[AioThread]:
    """Start a thread running a fresh asyncio loop; stop, drain and join it on exit."""
    # the loop class itself, not asyncio's policy: trio-asyncio, once imported, replaces the policy
    # and refuses to make a loop from within trio
    loop = asyncio.SelectorEventLoop()
    loop.set_exception_handler(_log_loop_error)
    thread = threading.Thread(target=_serve_loop, args=(loop,), name=name, daemon=True)
    thread.start()
    try:
        yield AioThread(loop)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        with trio.CancelScope(shield=True):  # bounded by join's own timeout
            await trio.to_thread.run_sync(thread.join, STOP_GRACE + 2.0)
        if thread.is_alive():
            log.warning("the asyncio thread did not stop within %.0fs", STOP_GRACE + 2.0)


#: ``await aio(fn, *args)`` runs the asyncio coroutine function ``fn`` from trio: ``AioThread.run`` in
#: meshnode's programs, ``via_trio_asyncio`` in code that runs inside a trio-asyncio loop (some tests)
AioRun = Callable[..., Awaitable[Any]]


async def via_trio_asyncio(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``AioRun`` for code inside ``trio_asyncio.open_loop()``."""
    import trio_asyncio

    result: T = await trio_asyncio.aio_as_trio(fn)(*args)
    return result
