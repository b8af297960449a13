"""``FrameStream``: one Session stream to another node, the only client side of it.

The initiator holds one to the head; every other hop holds one to the next hop.
Every grpc failure on it becomes a typed error naming the endpoint (``translate``),
so no caller above transport/ sees grpc.

Two ways to use a stream, never both on one:

* ``write`` / ``read``: the caller reads every reply itself (the initiator: a
  Generate answers one frame with many results, a credit grant with none).
* ``send`` / ``exchange``: every frame gets exactly one reply, in order (a hop's
  frames to the next hop: steps, cancels, releases). ``send`` returns at once
  with a future of that reply, so a hop can pass chunk *k* on and take chunk
  *k + 1* while the next hop computes *k*; one reader task resolves the
  futures in the order their frames went out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

import grpc

from meshnode import errors
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport.client import open_channel, translate

#: seconds a hang-up waits for its half-close to be sent
CLOSE_TIMEOUT = 1.0


class FrameStream:
    """``node_id``: the node the caller means to reach (the channel is pinned to it: transport/security.py);
    None pins whoever the endpoint's certificate names. The channel opens on the first write."""

    def __init__(self, endpoint: str, node_id: str | None = None) -> None:
        self.endpoint = endpoint
        self.node_id = node_id
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._connecting = asyncio.Lock()
        #: replies owed by the other side, oldest first (``send`` mode)
        self._owed: collections.deque[asyncio.Future[pb.SessionReply]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._broken: errors.MeshnodeError | None = None

    async def _connect(self) -> Any:
        """The Session call, opened (TLS pinned to ``node_id``) on first use."""
        if self._call is None:
            async with self._connecting:
                if self._call is None:
                    if self._broken is not None:
                        raise self._broken
                    self._channel = await open_channel(self.endpoint, self.node_id)
                    self._call = pb_grpc.NodeStub(self._channel).Session()
        return self._call

    async def write(self, frame: pb.SessionFrame) -> None:
        call = await self._connect()
        try:
            await call.write(frame)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.endpoint, "Session") from e
        except asyncio.InvalidStateError as e:  # grpc: the call already ended (the peer died)
            raise errors.PeerError("the session stream ended (peer gone)", hop=self.endpoint) from e

    async def read(self, timeout: float | None) -> pb.SessionReply:
        """The next reply (error frames included); DeadlineError after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):  # in this task: wait_for would start one per read
                reply = await (await self._connect()).read()
        except TimeoutError:
            raise errors.DeadlineError(f"no answer within {timeout:.1f}s", hop=self.endpoint) from None
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.endpoint, "Session") from e
        if reply is grpc.aio.EOF:
            raise errors.PeerError("closed the session stream", hop=self.endpoint)
        assert isinstance(reply, pb.SessionReply)
        return reply

    async def send(self, frame: pb.SessionFrame) -> asyncio.Future[pb.SessionReply]:
        """Write a frame that gets exactly one reply; returns the future of that reply."""
        if self._broken is not None:
            raise self._broken
        fut: asyncio.Future[pb.SessionReply] = asyncio.get_running_loop().create_future()
        self._owed.append(fut)
        try:
            await self.write(frame)
        except BaseException:
            with contextlib.suppress(ValueError):  # the reader may have failed (and dropped) it already
                self._owed.remove(fut)
            fut.cancel()
            raise
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read_replies())
        return fut

    async def exchange(self, frame: pb.SessionFrame, timeout: float | None) -> pb.SessionReply:
        """``send`` and wait (up to ``timeout`` seconds) for the reply."""
        return await self.wait(await self.send(frame), timeout)

    async def wait(self, fut: asyncio.Future[pb.SessionReply], timeout: float | None) -> pb.SessionReply:
        try:
            async with asyncio.timeout(timeout):
                return await fut  # a timeout cancels the future: the reader skips its reply when it comes
        except TimeoutError:
            raise errors.DeadlineError(f"no answer within {timeout:.1f}s", hop=self.endpoint) from None

    async def _read_replies(self) -> None:
        try:
            while True:
                reply = await self.read(None)
                if not self._owed:
                    raise errors.PeerError("sent a reply no frame asked for", hop=self.endpoint)
                fut = self._owed.popleft()
                if not fut.done():
                    fut.set_result(reply)
        except errors.MeshnodeError as e:
            self._fail(e)
        except asyncio.CancelledError:
            self._fail(errors.PeerError("the session stream was closed", hop=self.endpoint))
            raise

    def _fail(self, e: errors.MeshnodeError) -> None:
        self._broken = e
        while self._owed:
            fut = self._owed.popleft()
            if not fut.done():
                fut.set_exception(e)

    async def close(self) -> None:
        """Hang up: half-close, cancel the call, fail every reply still owed."""
        if self._call is not None:
            # the call may be over already, or its peer silent with the send window full (a partition):
            # closing is best effort, and bounded
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call.done_writing(), CLOSE_TIMEOUT)
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.wait([self._reader])  # its end is collected there (it fails what is owed)
        self._fail(errors.PeerError("the session stream was closed", hop=self.endpoint))
        if self._channel is not None:
            await self._channel.close(grace=None)
