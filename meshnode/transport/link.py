"""Links: the Session streams from one hop to the next, bundled into one gRPC stream.

A hop runs a batch of several sessions' rows in one ``llama_decode`` and then
passes each session's residual on. Over one Session stream per session that is
one gRPC message (and one wake-up of the next hop's reader) per session and
step; over a link it is one message per batch: what the sessions' streams post
while one message is being written leaves together in the next (``_Outbox``).

Each session keeps a virtual stream of its own on the link (``LinkStream``, a
``FrameStream`` for everything above transport/): its own frames, replies,
credits, cancels and failover, exactly as on a Session stream. The receiver
serves each virtual stream with the same session code as a Session call
(``serve_link``). A link that breaks breaks every virtual stream on it, each
failing as its own Session stream would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError

from meshnode import errors
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport.client import open_channel, translate
from meshnode.transport.stream import FrameStream

log = logging.getLogger("meshnode.transport")

#: virtual streams one link carries at once (a node hosts at most its max sessions; ended ones leave)
MAX_LINK_STREAMS = 1024
#: frames waiting for one virtual stream's session to read them (credits bound what a session sends)
MAX_QUEUED = 256
#: entries in one link message
MAX_ENTRIES = 1024
#: bytes of entries a message bundles before the rest wait for the next (a single entry goes alone)
MAX_BUNDLE_BYTES = 16 << 20

M = TypeVar("M", pb.LinkFrame, pb.LinkReply)
E = TypeVar("E", pb.LinkEntry, pb.LinkReplyEntry)


class _Outbox(Generic[M, E]):
    """One link direction's writer: entries posted while a message is being written go in the next one."""

    def __init__(self, write: Callable[[M], Awaitable[Any]], make: Callable[[list[E]], M],
                 sent: Callable[[int], None] = lambda n: None) -> None:
        self._write: Callable[[M], Awaitable[Any]] = write
        self._make: Callable[[list[E]], M] = make
        self._sent = sent
        self._pending: list[E] = []
        self._task: asyncio.Task[None] | None = None
        self.broken: str | None = None

    def post(self, entry: E) -> None:
        if self.broken is not None:
            raise errors.PeerError(f"the link broke: {self.broken}")
        self._pending.append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        while self._pending:
            batch: list[E] = []
            size = 0
            while self._pending and len(batch) < MAX_ENTRIES:
                n = self._pending[0].ByteSize()
                if batch and size + n > MAX_BUNDLE_BYTES:
                    break
                batch.append(self._pending.pop(0))
                size += n
            try:
                await self._write(self._make(batch))
            except Exception as e:  # the call is over (peer gone, cancelled): nothing more goes out
                self.broken = repr(e)
                self._pending.clear()
                return
            self._sent(len(batch))

    async def close(self, timeout: float) -> None:
        """Let what is posted go out (bounded), then stop."""
        await finish(self._task, timeout)


async def finish(task: asyncio.Task[None] | None, timeout: float) -> None:
    """Let a writer's pump ``task`` end by itself within ``timeout`` seconds, else cancel it; either way
    it is over on return (cancelling the caller does not cut the wait short of that)."""
    if task is not None and not task.done():
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), timeout)
        task.cancel()
        await asyncio.wait([task])


# -- the receiving hop ------------------------------------------------------------------------------------------


class InboundStream:
    """One virtual stream at the receiving hop, as the session host reads and writes a stream."""

    def __init__(self, number: int, out: _Outbox[pb.LinkReply, pb.LinkReplyEntry]) -> None:
        self.number = number
        self._out = out
        self._queue: asyncio.Queue[pb.SessionFrame | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def read(self) -> pb.SessionFrame | None:
        return await self._queue.get()

    async def write(self, reply: pb.SessionReply) -> None:
        self._out.post(pb.LinkReplyEntry(stream=self.number, reply=reply))

    def feed(self, frame: pb.SessionFrame | None) -> bool:
        """Queue a frame (None: the sender hung up); False if the session has let too many wait."""
        if self._queue.qsize() >= MAX_QUEUED:
            return False
        self._queue.put_nowait(frame)
        return True


def _ended_task(ended: Callable[[InboundStream], None], vs: InboundStream, task: asyncio.Task[None]) -> None:
    ended(vs)


async def serve_link(context: Any, serve: Callable[[InboundStream], Awaitable[None]],
                     counted: Callable[[str, int], None] = lambda direction, n: None) -> None:
    """A Link call's server end: each virtual stream served by ``serve`` (the session host's) in a task
    of its own, as gRPC serves each Session call. The link ending (the sender gone, or bytes that are
    not a LinkFrame) cancels every session still on it, as a Session call's end cancels its handler."""
    out: _Outbox[pb.LinkReply, pb.LinkReplyEntry] = _Outbox(
        context.write, lambda es: pb.LinkReply(entries=es), lambda n: counted("out", n))
    streams: dict[int, InboundStream] = {}

    def ended(vs: InboundStream) -> None:
        """A virtual stream is over (served to its end, or cancelled, even before it started)."""
        if streams.get(vs.number) is vs:
            del streams[vs.number]
        with contextlib.suppress(errors.PeerError):
            out.post(pb.LinkReplyEntry(stream=vs.number, ended=True))

    try:
        while True:
            try:
                msg = await context.read()
            except DecodeError:
                log.warning("a link sent bytes that are not a LinkFrame: it is cut")
                return
            if msg is grpc.aio.EOF:
                return
            if len(msg.entries) > MAX_ENTRIES:
                log.warning("a link sent %d entries in one message (at most %d): it is cut", len(msg.entries),
                            MAX_ENTRIES)
                return
            counted("in", len(msg.entries))
            for e in msg.entries:
                vs = streams.get(e.stream)
                if e.close:
                    if vs is not None and vs.task is not None:
                        vs.task.cancel()  # as a cancelled Session call's handler is
                    continue
                if not e.HasField("frame"):
                    continue
                if vs is None:
                    if len(streams) >= MAX_LINK_STREAMS:
                        out.post(pb.LinkReplyEntry(stream=e.stream, ended=True, reply=pb.SessionReply(
                            route_session_id=e.frame.route_session_id, error=pb.Error(
                                code=pb.RESOURCE_EXHAUSTED, terminal=True,
                                message=f"this link carries {MAX_LINK_STREAMS} streams already"))))
                        continue
                    vs = streams[e.stream] = InboundStream(e.stream, out)
                    vs.task = asyncio.ensure_future(serve(vs))
                    vs.task.add_done_callback(functools.partial(_ended_task, ended, vs))
                if not vs.feed(e.frame) and vs.task is not None:
                    log.warning("link stream %d let %d frames wait unread: it is cut", e.stream, MAX_QUEUED)
                    vs.task.cancel()
    finally:
        tasks = [vs.task for vs in streams.values() if vs.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)  # each session's clean-up (detach, free) runs to its end
        await out.close(1.0)


# -- the sending hop --------------------------------------------------------------------------------------------

_END = object()


class Link:
    """One Link call to a node (TLS pinned to ``node_id``), carrying the virtual streams of many sessions."""

    def __init__(self, endpoint: str, node_id: str | None) -> None:
        self.endpoint, self.node_id = endpoint, node_id
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._out: _Outbox[pb.LinkFrame, pb.LinkEntry] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._streams: dict[int, LinkStream] = {}
        self._next = 0
        self.broken: errors.MeshnodeError | None = None
        #: a stream on it waited in vain (the peer silent: a partition?): new sessions take a new link
        self.stale = False

    def stream(self) -> LinkStream:
        self._next += 1
        s = self._streams[self._next] = LinkStream(self, self._next)
        return s

    async def post(self, entry: pb.LinkEntry) -> None:
        if self.broken is not None:
            raise self.broken
        if self._out is None:
            async with self._connecting:
                if self._out is None:
                    self._channel = await open_channel(self.endpoint, self.node_id)
                    self._call = pb_grpc.NodeStub(self._channel).Link()
                    self._out = _Outbox(self._call.write, lambda es: pb.LinkFrame(entries=es))
                    self._reader = asyncio.ensure_future(self._read())
        if self.broken is not None:
            raise self.broken
        try:
            self._out.post(entry)
        except errors.PeerError as e:
            raise errors.PeerError(e.message, hop=self.endpoint) from None

    def forget(self, number: int) -> None:
        self._streams.pop(number, None)
        if self.stale and not self._streams and self._call is not None:
            self._call.cancel()  # nobody uses it any more: its reader ends, the channel closes

    async def _read(self) -> None:
        why: errors.MeshnodeError = errors.PeerError("the link was closed", hop=self.endpoint)
        try:
            while True:
                try:
                    msg = await self._call.read()
                except grpc.aio.AioRpcError as e:
                    why = translate(e, self.endpoint, "Link")
                    return
                if msg is grpc.aio.EOF:
                    why = errors.PeerError("closed the link", hop=self.endpoint)
                    return
                for entry in msg.entries:
                    s = self._streams.get(entry.stream)
                    if s is None:
                        continue
                    if entry.HasField("reply"):
                        s._deliver(entry.reply)
                    if entry.ended:
                        s._deliver(_END)
                        self.forget(entry.stream)
        finally:
            self.broken = why
            for s in list(self._streams.values()):
                s._deliver(why)
            self._streams.clear()
            if self._call is not None:
                self._call.cancel()
            if self._channel is not None:
                with contextlib.suppress(Exception):
                    await self._channel.close(grace=None)


class LinkStream(FrameStream):
    """One session's stream to the next hop, carried on a ``Link``: a ``FrameStream`` to its users."""

    def __init__(self, link: Link, number: int) -> None:
        super().__init__(link.endpoint, link.node_id)
        self._link, self._number = link, number
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._over: errors.MeshnodeError | None = None
        self._hung_up = False

    def _deliver(self, item: Any) -> None:
        self._inbox.put_nowait(item)

    async def write(self, frame: pb.SessionFrame) -> None:
        if self._hung_up or self._over is not None:
            raise self._over or errors.PeerError("the session stream was closed", hop=self.endpoint)
        await self._link.post(pb.LinkEntry(stream=self._number, frame=frame))

    async def wait(self, fut: asyncio.Future[pb.SessionReply], timeout: float | None) -> pb.SessionReply:
        try:
            return await super().wait(fut, timeout)
        except errors.DeadlineError:
            self._link.stale = True  # its connection may be dead without a word (a partition)
            raise

    async def read(self, timeout: float | None) -> pb.SessionReply:
        if self._over is not None:
            raise self._over
        try:
            async with asyncio.timeout(timeout):
                item = await self._inbox.get()
        except TimeoutError:
            raise errors.DeadlineError(f"no answer within {timeout:.1f}s", hop=self.endpoint) from None
        if isinstance(item, pb.SessionReply):
            return item
        self._over = item if isinstance(item, errors.MeshnodeError) else errors.PeerError(
            "closed the session stream", hop=self.endpoint)
        raise self._over

    async def close(self) -> None:
        """Hang up (the receiver cancels the session's handling, as for a cancelled Session call); fail
        every reply still owed. The link stays for other sessions."""
        if not self._hung_up:
            self._hung_up = True
            if self._link.broken is None and self._over is None:
                with contextlib.suppress(errors.MeshnodeError):
                    await self._link.post(pb.LinkEntry(stream=self._number, close=True))
            self._link.forget(self._number)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait([self._reader])
        self._fail(errors.PeerError("the session stream was closed", hop=self.endpoint))


#: this process's links, one per event loop and next node (endpoint and pinned node id)
_LINKS: dict[tuple[int, str, str | None], Link] = {}


def link_stream(endpoint: str, node_id: str | None) -> LinkStream:
    """A new session's stream to ``endpoint`` (pinned to ``node_id``) on this loop's link to it (a new
    link if there is none yet, it broke, or a stream on it waited in vain)."""
    key = (id(asyncio.get_running_loop()), endpoint, node_id)
    link = _LINKS.get(key)
    if link is None or link.broken is not None or link.stale:
        link = _LINKS[key] = Link(endpoint, node_id)
    return link.stream()
