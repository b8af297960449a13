"""The Node gRPC service: gRPC's side of a node, over the sessions it hosts (session/host.py).

Each RPC is translated here and nowhere else: a Session stream becomes a ``replies.Stream``
(bytes that are not a SessionFrame: WireError; the peer's half-close: None) served by
``SessionHost.serve``; a unary call's typed error becomes its gRPC status (a control that does
not verify or is not its initiator's: PERMISSION_DENIED; no such session of the caller's:
NOT_FOUND; bad input: INVALID_ARGUMENT; a node that cannot answer it: FAILED_PRECONDITION),
with the error's code leading the details.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError

from meshnode import errors
from meshnode.executor.api import RangeExecutor
from meshnode.metrics import NodeMetrics
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport.link import InboundStream, serve_link


class _GrpcStream:
    """A Session call's server end as a ``replies.Stream``."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def read(self) -> pb.SessionFrame | None:
        try:
            frame = await self._context.read()
        except DecodeError as e:  # grpc's deserializer raises protobuf's error out of ``read``
            raise errors.WireError(f"a message on this stream is not a SessionFrame ({e})") from None
        return None if frame is grpc.aio.EOF else frame

    async def write(self, reply: pb.SessionReply) -> None:
        await self._context.write(reply)


class Host(Protocol):
    """The sessions a node hosts, as this service needs them (session/host.py's ``SessionHost``; wired
    in node.py: transport does not import session)."""

    def current_capability(self) -> pb.Capability: ...

    def health(self) -> pb.HealthReply: ...

    def authorize(self, env: pb.SignedEnvelope, sid: str, action: str, work: str) -> None: ...

    async def release(self, sid: str) -> pb.ReleaseReply: ...

    async def cancel(self, sid: str, work: str) -> pb.CancelReply: ...

    def outputs(self, request: pb.OutputsRequest) -> pb.OutputsReply: ...

    async def serve(self, stream: _GrpcStream | InboundStream) -> None: ...

    @property
    def metrics(self) -> NodeMetrics: ...


class Directory(Protocol):
    """The records a node carries (directory/carried.py's ``CarriedDirectory``)."""

    def answer(self, req: pb.RecordsRequest) -> pb.RecordBatch: ...


class ModelShare(Protocol):
    """The bytes of the model a node holds, for peers that fetch it (fetch/share.py's ``Share``)."""

    def serve(self, req: pb.FetchRequest, requester: str) -> AsyncIterator[pb.FetchChunk]: ...


def requester_of(peer: str) -> str:
    """The address part of grpc's peer string (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``): one
    requester whatever port its connection came from."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")] if "]" in rest else rest
    host, _, _ = rest.rpartition(":")
    return host or peer


#: a Fetch's typed refusal -> its gRPC status
_FETCH_STATUS = {
    "FETCH_BUSY": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "MODEL_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
}


async def _abort(context: Any, status: grpc.StatusCode, e: errors.MeshnodeError) -> NoReturn:
    await context.abort(status, f"{e.code}: {e.message}")
    raise AssertionError("unreachable") from e


class NodeServicer(pb_grpc.NodeServicer):
    def __init__(self, host: Host, executor: RangeExecutor, share: ModelShare | None = None,
                 directory: Directory | None = None) -> None:
        self.host = host
        self.executor = executor
        self.share = share
        self.directory = directory

    async def GetCapability(self, request: pb.CapabilityRequest, context: Any) -> pb.Capability:
        return self.host.current_capability()

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        return self.host.health()

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeReply:
        vocab = self.executor.vocab
        if vocab is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node's range carries no vocabulary")
        assert vocab is not None
        if not request.messages:
            return pb.TokenizeReply(tokens=vocab.tokenize(request.text, add_special=request.add_special,
                                                          parse_special=request.parse_special), bos_token=vocab.bos)
        try:
            chat = vocab.chat_format().render([{"role": m.role, "content": m.content} for m in request.messages])
        except errors.InputError as e:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, e)
        except errors.MeshnodeError as e:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, e)
        return pb.TokenizeReply(tokens=vocab.tokenize(chat.text, add_special=chat.add_bos, parse_special=True),
                                bos_token=vocab.bos, stop=list(chat.stop))

    async def _authorize(self, context: Any, env: pb.SignedEnvelope, sid: str, action: str, work: str) -> None:
        try:
            self.host.authorize(env, sid, action, work)
        except errors.MeshnodeError as e:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, e)

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        await self._authorize(context, request.auth, request.route_session_id, "release", "")
        return await self.host.release(request.route_session_id)

    async def Cancel(self, request: pb.CancelRequest, context: Any) -> pb.CancelReply:
        await self._authorize(context, request.auth, request.route_session_id, "cancel", request.work_id)
        return await self.host.cancel(request.route_session_id, request.work_id)

    async def Outputs(self, request: pb.OutputsRequest, context: Any) -> pb.OutputsReply:
        try:
            return self.host.outputs(request)
        except errors.UnknownSessionError as e:
            await _abort(context, grpc.StatusCode.NOT_FOUND, e)
        except errors.MeshnodeError as e:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, e)

    async def Session(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        await self.host.serve(_GrpcStream(context))

    async def Link(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        """Many Session streams from one hop as one call (transport/link.py)."""
        m = self.host.metrics
        await serve_link(context, self.host.serve, lambda direction, n: m.link(direction, n))

    async def Fetch(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[pb.FetchChunk]:
        """Bytes of the model this node holds (fetch/share.py): a refusal is a status before any chunk."""
        if self.share is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "MODEL_NOT_FOUND: this node shares no model bytes")
        assert self.share is not None
        try:
            async for chunk in self.share.serve(request, requester_of(context.peer())):
                yield chunk
        except errors.MeshnodeError as e:
            await _abort(context, _FETCH_STATUS.get(e.code, grpc.StatusCode.FAILED_PRECONDITION), e)

    async def Records(self, request: pb.RecordsRequest, context: Any) -> pb.RecordBatch:
        """Peer exchange (directory/carried.py): the caller's records checked and kept, ours answered."""
        if self.directory is None:
            return pb.RecordBatch()
        return self.directory.answer(request)
