"""Clients of other nodes' unary RPCs, with grpc errors translated to typed ones."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from meshnode import errors
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport import security
from meshnode.transport.security import channel_options, open_channel
from meshnode.wire.schema import SCHEMA_VERSION, SERVICE_NAME

__all__ = [
    "channel_options",
    "get_capability",
    "health",
    "open_channel",
    "release",
    "tokenize",
    "tokenize_chat",
    "tokenize_with_bos",
    "translate",
]


def translate(e: grpc.aio.AioRpcError, endpoint: str, what: str) -> errors.MeshnodeError:
    code = e.code()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return errors.NotAMeshnodeError(f"does not speak the meshnode protocol ({what}: UNIMPLEMENTED)", hop=endpoint)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineError(f"{what} timed out", hop=endpoint)
    if code == grpc.StatusCode.UNAVAILABLE:
        was = security.pinned(endpoint)
        security.forget(endpoint)  # the next channel checks the certificate again (a restarted node's, or not)
        details = e.details() or ""
        if was is not None and ("andshake" in details or "certificate" in details.lower()):
            return errors.ImpostorError(f"did not prove it is node {was}: the TLS handshake with that node's "
                                        f"certificate failed ({details}); an impostor, or the node was replaced",
                                        hop=endpoint)
        hint = (": this client is --insecure, and a node that speaks TLS closes plaintext connections"
                if security.insecure() else "")
        return errors.PeerError(f"unreachable or not a gRPC server ({details}){hint}", hop=endpoint)
    typed, _, message = (e.details() or "").partition(": ")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION) and typed in errors.BY_CODE:
        return errors.from_code(typed, message, hop=endpoint)  # the peer's typed refusal, e.g. of our input
    return errors.PeerError(f"{what} failed: {code.name} {e.details()}", hop=endpoint)


async def get_capability(endpoint: str, timeout: float = 5.0, node_id: str | None = None, *,
                         plaintext: bool | None = None) -> pb.Capability:
    """The peer's capability; NotAMeshnodeError if it is some other server.

    With ``node_id`` the endpoint must be that node (ImpostorError otherwise); over TLS the capability
    must be signed by the node the certificate is bound to, whatever ``node_id`` says.
    """
    async with await open_channel(endpoint, node_id, plaintext=plaintext) as ch:
        try:
            cap: pb.Capability = await pb_grpc.NodeStub(ch).GetCapability(
                pb.CapabilityRequest(schema_version=SCHEMA_VERSION), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "GetCapability") from e
    if cap.service != SERVICE_NAME:
        raise errors.NotAMeshnodeError(f"answers as {cap.service!r}, not {SERVICE_NAME!r}", hop=endpoint)
    if cap.schema_version != SCHEMA_VERSION:
        raise errors.SchemaError(f"speaks schema {cap.schema_version}, this client {SCHEMA_VERSION}", hop=endpoint)
    tls_id = security.pinned(endpoint)
    if not (security.insecure() if plaintext is None else plaintext) and tls_id is not None and cap.node_id != tls_id:
        raise errors.ImpostorError(f"its TLS certificate is node {tls_id}'s but its capability claims "
                                   f"{cap.node_id}: refused", hop=endpoint)
    return cap


async def tokenize(endpoint: str, text: str, timeout: float = 10.0) -> list[int]:
    return (await tokenize_with_bos(endpoint, text, timeout))[0]


async def tokenize_with_bos(endpoint: str, text: str, timeout: float = 10.0,
                            node_id: str | None = None) -> tuple[list[int], int]:
    """The token ids of ``text`` (as llama.cpp tokenizes by default) and the vocabulary's BOS id (-1: none)."""
    async with await open_channel(endpoint, node_id) as ch:
        try:
            reply = await pb_grpc.NodeStub(ch).Tokenize(
                pb.TokenizeRequest(text=text, add_special=True, parse_special=True), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "Tokenize") from e
    return list(reply.tokens), reply.bos_token


async def tokenize_chat(endpoint: str, messages: list[tuple[str, str]], timeout: float = 10.0,
                        node_id: str | None = None) -> tuple[list[int], int, list[str]]:
    """``(role, content)`` messages rendered by the node's chat format and tokenized:
    (tokens, the vocabulary's BOS id, the format's stop strings)."""
    req = pb.TokenizeRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
    async with await open_channel(endpoint, node_id) as ch:
        try:
            reply = await pb_grpc.NodeStub(ch).Tokenize(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "Tokenize") from e
    return list(reply.tokens), reply.bos_token, list(reply.stop)


async def release(endpoint: str, session_id: str, auth: pb.SignedEnvelope, timeout: float = 2.0) -> bool:
    """Out-of-band Release of a session (``auth``: a ControlOrder signed by its initiator); True if freed."""
    async with await open_channel(endpoint) as ch:
        try:
            reply = await pb_grpc.NodeStub(ch).Release(
                pb.ReleaseRequest(route_session_id=session_id, auth=auth), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "Release") from e
    return bool(reply.released)


async def health(endpoint: str, timeout: float = 5.0, node_id: str | None = None, *,
                 plaintext: bool | None = None) -> pb.HealthReply:
    async with await open_channel(endpoint, node_id, plaintext=plaintext) as ch:
        try:
            reply: pb.HealthReply = await pb_grpc.NodeStub(ch).Health(pb.HealthRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "Health") from e
    return reply


async def outputs(endpoint: str, node_id: str, session_id: str, auth: pb.SignedEnvelope, start: int, end: int,
                  timeout: float = 30.0) -> list[pb.TensorBundle]:
    """The residual rows a non-tail hop sent on for a session's chunks in positions [start, end)
    (``auth``: a ControlOrder "outputs" signed by the session's initiator); a reply may stop early
    (a size bound): ask again from the end of the last chunk."""
    async with await open_channel(endpoint, node_id) as ch:
        try:
            reply = await pb_grpc.NodeStub(ch).Outputs(
                pb.OutputsRequest(route_session_id=session_id, pos_start=start, pos_end=end, auth=auth),
                timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "Outputs") from e
    return list(reply.chunks)


async def fetch(endpoint: str, request: pb.FetchRequest, timeout: float = 600.0,
                node_id: str | None = None) -> AsyncIterator[pb.FetchChunk]:
    """The chunks a peer sends for a Fetch of model bytes (fetch/client.py checks them)."""
    async with await open_channel(endpoint, node_id) as ch:
        call = pb_grpc.NodeStub(ch).Fetch(request, timeout=timeout)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as e:
            typed, _, message = (e.details() or "").partition(": ")
            if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND) and typed in errors.BY_CODE:
                raise errors.from_code(typed, message, hop=endpoint) from e
            raise translate(e, endpoint, "Fetch") from e
        finally:
            call.cancel()


async def records(endpoint: str, request: pb.RecordsRequest, timeout: float = 10.0,
                  node_id: str | None = None) -> pb.RecordBatch:
    """Peer exchange with a node: the records it holds (each still to be checked by the caller)."""
    async with await open_channel(endpoint, node_id) as ch:
        try:
            reply: pb.RecordBatch = await pb_grpc.NodeStub(ch).Records(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise translate(e, endpoint, "Records") from e
    return reply
