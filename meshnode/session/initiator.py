"""The initiator side of a route session: check the route, prefill, decode, release.

``generate`` is one asyncio coroutine (run from trio with
``trio_asyncio.aio_as_trio``): the per-token loop crosses no trio<->asyncio
boundary. Every step carries a deadline, and every read waits at most until
it, so a dead hop surfaces as a typed error naming it, never a hang.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from meshnode import errors
from meshnode.identity import NodeIdentity, load_or_create
from meshnode.identity.attest import verify_attestation
from meshnode.identity.routeauth import HopPlan, check_acceptances, sign_route
from meshnode.paths import state_dir
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.routing.chain import PeerView, check_chain
from meshnode.transport.client import get_capability, open_channel, tokenize, translate
from meshnode.wire import codec
from meshnode.wire.schema import SCHEMA_VERSION
from meshnode.wire.tensors import decode_bundle


@dataclass(frozen=True)
class GenerateConfig:
    #: raw completion text, tokenized by the head as llama.cpp does by default
    prompt: str
    #: stop after this many generated tokens (or at end-of-generation)
    max_tokens: int = 32
    #: 0 = greedy
    temperature: float = 0.0
    #: RNG seed for temperature > 0
    seed: int = 0
    #: residual dtype on the wire: DTYPE_F32 (bit-exact) or DTYPE_F16 (not bit-exact)
    wire_dtype: int = pb.DTYPE_F32
    #: seconds each step may take end to end
    step_timeout: float = 30.0
    #: ask the tail for each step's logits (tests and parity checks)
    return_logits: bool = False
    #: delegated decode: the head runs the decode loop (Generate); False = one Step per token from here
    delegate: bool = True


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: list[int]
    stop_reason: str  # "eog" | "length"
    prefill_seconds: float
    decode_seconds: float
    route: list[str]
    logits: list[np.ndarray] = field(default_factory=list)
    #: wire bytes received per hop per decoded token (activation payloads)
    bytes_per_token: dict[str, float] = field(default_factory=dict)


def peer_view(endpoint: str, cap: pb.Capability) -> PeerView:
    return PeerView(endpoint, cap.model_fingerprint, cap.n_layer, cap.range.start, cap.range.end,
                    codec.numerics_key(cap.numerics))


def check_attested(endpoint: str, cap: pb.Capability, now: int) -> None:
    """The capability's own signed attestation must vouch for what it claims."""
    try:
        verify_attestation(cap.attestation, now=now, fingerprint=cap.model_fingerprint, start=cap.range.start,
                           end=cap.range.end, range_digest=cap.range_digest, node_id=cap.node_id)
    except errors.MeshnodeError as e:
        e.hop = endpoint
        raise


async def check_route(peers: Sequence[str], timeout: float = 5.0) -> list[pb.Capability]:
    caps = await asyncio.gather(*(get_capability(p, timeout) for p in peers))
    now = int(time.time())
    for p, c in zip(peers, caps, strict=True):
        check_attested(p, c, now)
    check_chain([peer_view(p, c) for p, c in zip(peers, caps, strict=True)])
    return list(caps)


class RouteSession:
    """One open route session on the head's Session stream."""

    def __init__(self, peers: Sequence[str], caps: Sequence[pb.Capability], cfg: GenerateConfig,
                 ident: NodeIdentity | None = None) -> None:
        self.peers, self.caps, self.cfg = list(peers), list(caps), cfg
        self.ident = ident or load_or_create(state_dir())
        self.id = str(uuid.uuid4())
        self.epoch = 1
        self.step_id = 0
        self.n_past = 0
        self.limits = pb.FlowLimits()
        self._channel = open_channel(peers[0])
        self._call = pb_grpc.NodeStub(self._channel).Session()

    async def _write(self, frame: pb.SessionFrame) -> None:
        try:
            await self._call.write(frame)
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.peers[0], "Session") from e
        except asyncio.InvalidStateError as e:  # grpc: the call already ended (the head died)
            raise errors.PeerError("the session stream ended (peer gone)", hop=self.peers[0]) from e

    async def _exchange(self, frame: pb.SessionFrame) -> pb.SessionReply:
        await self._write(frame)
        return await self._read()

    async def _read(self) -> pb.SessionReply:
        try:
            reply = await asyncio.wait_for(self._call.read(), self.cfg.step_timeout)
        except TimeoutError:
            raise errors.DeadlineError(f"no answer within {self.cfg.step_timeout}s", hop=self.peers[0]) from None
        except grpc.aio.AioRpcError as e:
            raise translate(e, self.peers[0], "Session") from e
        if reply is grpc.aio.EOF:
            raise errors.PeerError("closed the session stream", hop=self.peers[0])
        assert isinstance(reply, pb.SessionReply)
        if reply.HasField("error"):
            raise codec.error_from_pb(reply.error)
        return reply

    async def open(self) -> pb.SessionAccepted:
        head = self.caps[0]
        plans = [HopPlan(c.node_id, c.attestation.signer_public_key, c.range.start, c.range.end) for c in self.caps]
        opens = sign_route(self.ident, session_id=self.id, epoch=self.epoch, fingerprint=head.model_fingerprint,
                           hops=plans, now=int(time.time()))
        rest = list(zip(self.peers[1:], self.caps[1:], opens[1:], strict=True))
        o = pb.SessionOpen(
            schema_version=SCHEMA_VERSION, route_session_id=self.id, route_epoch=self.epoch,
            model_fingerprint=head.model_fingerprint, range=head.range, signed_open=opens[0],
            downstream=[pb.Hop(endpoint=p, range=c.range, node_id=c.node_id, signed_open=s) for p, c, s in rest],
            limits=head.limits, wire_dtype=self.cfg.wire_dtype,  # type: ignore[arg-type]
            sampling=pb.Sampling(temperature=self.cfg.temperature, seed=self.cfg.seed, top_p=1.0),
            numerics=head.numerics, return_logits=self.cfg.return_logits,
            deadline_unix_nanos=codec.deadline_in(self.cfg.step_timeout),
        )
        reply = await self._exchange(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, open=o))
        if not reply.HasField("accepted"):
            raise errors.PeerError("answered the open with something else", hop=self.peers[0])
        check_acceptances(list(reply.accepted.acceptances), opens, plans)
        self.limits = reply.accepted.limits
        return reply.accepted

    async def step(self, tokens: Sequence[int], *, sample: bool) -> pb.StepResult:
        self.step_id += 1
        s = pb.Step(step_id=self.step_id, tokens=list(tokens), sample=sample,
                    cache=pb.CacheExpectation(n_past=self.n_past),
                    deadline_unix_nanos=codec.deadline_in(self.cfg.step_timeout))
        reply = await self._exchange(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, step=s))
        if not reply.HasField("result") or reply.result.step_id != self.step_id:
            raise errors.PeerError(f"answered step {self.step_id} with something else", hop=self.peers[0])
        self.n_past += len(tokens)
        return reply.result

    async def generate(self, token: int, max_tokens: int) -> AsyncIterator[pb.StepResult]:
        """Delegated decode: the head loops; yields one result per generated token."""
        g = pb.Generate(first_step_id=self.step_id + 1, token=token, n_past=self.n_past, max_tokens=max_tokens,
                        step_timeout_nanos=int(self.cfg.step_timeout * 1e9))
        await self._write(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, generate=g))
        while True:
            reply = await self._read()
            if not reply.HasField("result") or reply.result.step_id != self.step_id + 1:
                raise errors.PeerError(f"answered step {self.step_id + 1} with something else", hop=self.peers[0])
            self.step_id += 1
            self.n_past += 1
            yield reply.result
            if reply.result.last:
                return

    async def release(self) -> None:
        try:
            await self._exchange(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch,
                                                 release=pb.ReleaseSignal()))
        finally:
            await self.close()

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close(grace=None)


async def generate(peers: Sequence[str], cfg: GenerateConfig, ident: NodeIdentity | None = None) -> GenerationResult:
    """Generate across the route ``peers`` (in layer order)."""
    if cfg.max_tokens < 1:
        raise errors.InputError("--max-tokens must be at least 1")
    caps = await check_route(peers)
    prompt = await tokenize(peers[-1], cfg.prompt)  # the tail carries the vocabulary
    if not prompt:
        raise errors.InputError("the prompt tokenizes to nothing")
    if len(prompt) + cfg.max_tokens > caps[0].numerics.n_ctx_per_session:
        raise errors.InputError(
            f"prompt ({len(prompt)} tokens) + --max-tokens ({cfg.max_tokens}) exceed the session "
            f"context of {caps[0].numerics.n_ctx_per_session} tokens"
        )
    rs = RouteSession(peers, caps, cfg, ident)
    try:
        await rs.open()
        return await _run(rs, prompt, cfg, caps)
    except BaseException:
        await rs.close()
        raise


async def _decode_results(
    rs: RouteSession, first: pb.StepResult, cfg: GenerateConfig
) -> AsyncGenerator[pb.StepResult, None]:
    """The prefill's result, then one per decoded token (delegated to the head, or step by step)."""
    yield first
    if first.end_of_generation or cfg.max_tokens <= 1:
        return
    if cfg.delegate:
        async for r in rs.generate(first.token, cfg.max_tokens - 1):
            yield r
        return
    result = first
    for _ in range(cfg.max_tokens - 1):
        result = await rs.step([result.token], sample=True)
        yield result
        if result.end_of_generation:
            return


async def _run(rs: RouteSession, prompt: list[int], cfg: GenerateConfig,
               caps: Sequence[pb.Capability]) -> GenerationResult:
    chunk = rs.limits.max_prefill_chunk_tokens or len(prompt)
    logits: list[np.ndarray] = []
    t0 = time.perf_counter()
    result = pb.StepResult()
    for i in range(0, len(prompt), chunk):
        part = prompt[i : i + chunk]
        result = await rs.step(part, sample=i + chunk >= len(prompt))
    prefill = time.perf_counter() - t0
    tokens: list[int] = []
    pieces: list[bytes] = []
    bytes_in: dict[str, int] = {}
    stop = "length"
    t1 = time.perf_counter()
    results = _decode_results(rs, result, cfg)
    async for result in results:
        if cfg.return_logits:
            logits.append(decode_bundle(result.logits, n_cols=result.logits.shape[1] if result.logits.shape else 0)[0])
        tokens.append(result.token)
        if len(tokens) > 1:
            for t in result.timings:
                bytes_in[t.endpoint] = bytes_in.get(t.endpoint, 0) + t.bytes_in
        if result.end_of_generation:
            stop = "eog"
            break
        pieces.append(result.piece)
        if len(tokens) >= cfg.max_tokens:
            break
    await results.aclose()
    decode = time.perf_counter() - t1
    await rs.release()
    steps = max(len(tokens) - 1, 1)
    return GenerationResult(
        tokens=tokens, text=b"".join(pieces).decode("utf-8", errors="replace"), prompt_tokens=prompt,
        stop_reason=stop, prefill_seconds=prefill, decode_seconds=decode, route=list(rs.peers), logits=logits,
        bytes_per_token={k: v / steps for k, v in bytes_in.items()},
    )
