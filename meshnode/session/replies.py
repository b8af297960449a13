"""One session stream's two sides at a hop: the replies going back up (``ReplyWriter``) and what
its reader and its executing side share (``Control``), over any ``Stream`` of frames (the gRPC
adapter is transport/servicer.py's)."""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from meshnode import errors
from meshnode.metrics import NodeMetrics
from meshnode.proto import node_pb2 as pb
from meshnode.session.flow import Flow
from meshnode.transport.link import finish
from meshnode.wire import codec

if TYPE_CHECKING:
    from meshnode.session.hop import HopSession


class Stream(Protocol):
    """The hop's end of one Session stream."""

    async def read(self) -> pb.SessionFrame | None:
        """The next frame; None once the peer has half-closed; WireError for bytes that are not a frame."""
        ...

    async def write(self, reply: pb.SessionReply) -> None:
        """Send one reply (raises once the stream is over)."""
        ...


class ReplyWriter:
    """Writes one stream's replies in order (a running Generate, the read loop and steps still
    waiting for the next hop all answer), and counts what is written into the node's metrics.

    ``post`` queues a reply and returns at once: a Generate goes on to its next token while its
    last result is still being sent (the send's completion would otherwise sit on every token's
    critical path). ``post_later`` queues a reply that is not there yet (an awaitable of it: a
    step the next hop is still computing), so the session's next step can start meanwhile; the
    replies behind it wait their turn. ``write`` queues and waits until everything queued so far
    is sent. A failed send ends the stream: every later ``post`` or ``write`` raises PeerError.
    """

    def __init__(self, stream: Stream, metrics: NodeMetrics) -> None:
        self._stream = stream
        self._metrics = metrics
        self._pending: collections.deque[tuple[pb.SessionReply | Awaitable[pb.SessionReply],
                                               Callable[[], None] | None]] = collections.deque()
        self._pump_task: asyncio.Task[None] | None = None
        self._failed: str | None = None

    def post(self, reply: pb.SessionReply, before: Callable[[], None] | None = None) -> None:
        """Queue ``reply``; ``before`` runs right before it is written (or dropped)."""
        self.post_later(reply, before)

    def post_later(self, reply: pb.SessionReply | Awaitable[pb.SessionReply],
                   before: Callable[[], None] | None = None) -> None:
        """Queue a reply or an awaitable of one (it must not raise); awaited in turn, then written."""
        if self._failed is not None:
            if inspect.iscoroutine(reply):
                reply.close()
            raise errors.PeerError(f"the stream to the previous hop broke: {self._failed}")
        self._pending.append((reply, before))
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.ensure_future(self._pump())

    async def write(self, reply: pb.SessionReply) -> None:
        self.post(reply)
        await self.flush()

    async def flush(self) -> None:
        """Wait until every queued reply is sent (cancelling the caller does not stop the sending)."""
        while self._pump_task is not None and not self._pump_task.done():
            await asyncio.shield(self._pump_task)
        if self._failed is not None:
            raise errors.PeerError(f"the stream to the previous hop broke: {self._failed}")

    async def _pump(self) -> None:
        try:
            while self._pending:
                item, before = self._pending[0]
                reply = item if isinstance(item, pb.SessionReply) else await item
                self._pending.popleft()
                if before is not None:
                    before()
                if self._failed is not None:
                    continue  # nothing more goes out; what is owed is still awaited, in order
                self._count(reply)
                try:
                    await self._stream.write(reply)
                except Exception as e:  # the RPC is over (peer gone, cancelled): nothing more goes out
                    self._failed = repr(e)
        finally:
            self._drop()

    def _drop(self) -> None:
        """The pump was stopped: what is still queued is never written (its hooks still run)."""
        while self._pending:
            item, before = self._pending.popleft()
            if inspect.iscoroutine(item):
                item.close()
            if before is not None:
                before()

    def _count(self, reply: pb.SessionReply) -> None:
        m = self._metrics
        m.bytes_out.inc(reply.ByteSize())
        if reply.HasField("error"):
            m.errors.labels(code=pb.ErrorCode.Name(reply.error.code)).inc()
        elif reply.HasField("result") and not reply.result.duplicate and reply.result.timings:
            mine = reply.result.timings[0]
            m.tokens.labels(kind="decode" if mine.n_tokens == 1 else "prefill").inc(mine.n_tokens)
            m.steps.observe(mine.handle_nanos / 1e9)

    async def error(self, session: HopSession, e: errors.MeshnodeError, *, terminal: bool | None = None) -> None:
        await self.write(pb.SessionReply(route_session_id=session.session_id,
                                         error=codec.error_to_pb(e, hop=session.endpoint, terminal=terminal)))

    async def close(self, timeout: float) -> None:
        """At the end of the handler: let what is queued go out (bounded), then stop."""
        await finish(self._pump_task, timeout)
        self._drop()



@dataclass
class Control:
    """What the reader and the executing side of one session stream share."""

    flow: Flow
    #: a Generate is queued or running: only cancel and release may come in meanwhile
    generating: bool = False
    #: set to end the running Generate after its current step
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: work id of the running Generate (an in-band cancel of it stops it)
    work_id: str | None = None
    #: frames in order, for the executing side (an error: answered, and the session is over; None: the
    #: stream is over)
    queue: asyncio.Queue[pb.SessionFrame | errors.MeshnodeError | None] = field(default_factory=asyncio.Queue)
    #: steps and grants refused for going beyond the credits (session/admission.py ``overrun``)
    overruns: int = 0
    #: a step's reply, once the next hop answered, was a terminal error: the session is over
    over: bool = False

    def end(self) -> None:
        self.over = True
        self.queue.put_nowait(None)
