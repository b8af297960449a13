"""The hop side of a route session: one ``HopSession`` per Session stream.

Runs as asyncio coroutines on the node's asyncio data-plane thread
(docs/architecture.md, "the bridge"); the per-token path never crosses into
trio. Per frame:

    read upstream -> validate -> llama.cpp (inline for a decode step, else the worker thread)
      -> (non-tail) send the residual downstream           <- ``start`` returns here
      -> the next hop's result -> write the result upstream (in order)

``start`` returns once the residual is on its way, with an awaitable of the
step's reply, so the stream's next step may start while the next hop is still
computing this one: a prompt's chunk *k + 1* here while chunk *k* is computed
further on (``transport/stream.py`` keeps the next hop's replies in order).

A failing step is answered with a typed ``Error`` frame; only terminal
errors end the stream. ``close()`` frees the KV slot and closes the
downstream stream, so a session never leaks.

Failover: a session whose stream breaks without a release is *detached*
(``detach()``: downstream closed, KV slot kept) for ``HopLimits.detach_grace``
seconds. An open with ``resume`` (a higher epoch, signed by the same
initiator) adopts it (``adopt()``), keeps the confirmed positions, and the
initiator's replay steps rebuild whichever hop holds nothing: a non-tail hop
keeps its output rows per chunk (``history``) so that it can pass them on for
positions it already holds, without recomputing them. A tail owns one
llama.cpp sampler chain per session (``executor/sampler.py``), made at the
open and, on a resume, rebuilt from the open's ``sampled`` tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from meshnode import errors
from meshnode.audit.seals import logits_digest, rows_digest, sign_step, tokens_digest
from meshnode.executor.api import RangeExecutor
from meshnode.executor.sampler import Chain
from meshnode.identity import NodeIdentity
from meshnode.identity.routeauth import accept, check_open, forward_proof, parse_open
from meshnode.proto import node_pb2 as pb
from meshnode.session.admission import Recent
from meshnode.session.drafts import check_draft, rollback_to, stands
from meshnode.session.flow import Flow
from meshnode.session.sampling import SamplingParams
from meshnode.session.sampling import from_pb as sampling_from_pb
from meshnode.transport.link import link_stream
from meshnode.transport.stream import FrameStream
from meshnode.wire import codec
from meshnode.wire.schema import SCHEMA_VERSION
from meshnode.wire.tensors import NP_DTYPES, decode_bundle, encode_bundle


@dataclass(frozen=True)
class HopLimits:
    """This node's own bounds for sessions (the strictest side wins at open)."""

    #: max bytes per fragment of a tensor bundle
    max_chunk_bytes: int = 1 << 20
    #: max tokens per prefill step (also bounded by the executor's n_batch)
    max_prefill_chunk_tokens: int = 512
    #: max unanswered steps per session
    credits: int = 4
    #: seconds a downstream hop may take to answer a step without a deadline
    step_timeout: float = 30.0
    #: seconds a broken session's KV state is kept for a resume (failover)
    detach_grace: float = 30.0
    #: seconds an open waits for a slot when all are taken (one may be freeing: its peer just hung up)
    admission_wait: float = 1.0
    #: sessions one initiator may open per minute, after a burst of ``opens_burst`` (session/admission.py)
    opens_per_minute: float = 600.0
    opens_burst: float = 60.0
    #: detached sessions kept at once (0: as many as session slots); beyond, the oldest is freed
    max_detached: int = 0
    #: times a stream may send a step or a grant beyond its credits (refused each time) before it is cut
    max_overruns: int = 8
    #: sessions' streams to the next hop share one link (transport/link.py), not a Session call each
    link: bool = True


def negotiate(a: pb.FlowLimits, b: pb.FlowLimits) -> pb.FlowLimits:
    """The strictest of two proposals, field by field (0 = no proposal)."""

    def pick(x: int, y: int) -> int:
        return min(v for v in (x, y) if v) if (x or y) else 0

    return pb.FlowLimits(
        max_chunk_bytes=pick(a.max_chunk_bytes, b.max_chunk_bytes),
        max_prefill_chunk_tokens=pick(a.max_prefill_chunk_tokens, b.max_prefill_chunk_tokens),
        credits=pick(a.credits, b.credits),
    )


T = TypeVar("T")


async def _ready(value: T) -> T:
    """An awaitable of a value that is already there (a tail's result, a duplicate's answer)."""
    return value


UINT64 = 2**64 - 1
#: seconds a hop waits for the next hop to confirm the release of a session it ends
RELEASE_TIMEOUT = 2.0
#: the longest deadline a Generate may give each of its steps
MAX_STEP_TIMEOUT_NS = 3600 * 10**9
#: work ids a session remembers as cancelled
MAX_CANCELLED_WORK = 256
#: fault injection for tests only (tests/test_audit.py plants a lying hop): every Nth step this hop
#: computes, it nudges one value of the residual it sends on by one ulp, or as a tail returns the token
#: after the one its chain drew (and seals what it sent)
LIE_EVERY = int(os.environ.get("MESHNODE_TEST_LIE_EVERY", "0") or 0)


@dataclass
class HopSession:
    executor: RangeExecutor
    capability: pb.Capability
    limits: HopLimits
    endpoint: str
    ident: NodeIdentity
    #: nonces of accepted route opens -> expiry (shared by the node's sessions)
    nonces: dict[bytes, int]
    session_id: str = ""
    epoch: int = 0
    slot: int | None = None
    open_msg: pb.SessionOpen | None = None
    negotiated: pb.FlowLimits = field(default_factory=pb.FlowLimits)
    downstream: FrameStream | None = None
    last_step_id: int = 0
    last_result: pb.StepResult | None = None
    #: work ids cancelled in this session (the last MAX_CANCELLED_WORK: a stranger's flood is bounded)
    cancelled_work: Recent = field(default_factory=lambda: Recent(MAX_CANCELLED_WORK))
    route_open: pb.RouteOpen = field(default_factory=pb.RouteOpen)
    #: a release or whole-session cancel went downstream (the hops after this one end it too)
    downstream_told: bool = False
    #: non-tail: this hop's output rows per chunk, by first position (for replay)
    history: dict[int, np.ndarray] = field(default_factory=dict)
    #: set once the stream handling this session has ended
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: may be kept for a resume when its stream breaks (not after release, cancel or a bug)
    detachable: bool = False
    #: monotonic time it was detached
    detached_at: float = 0.0
    #: tail: llama.cpp's sampler chain of this session (penalty window + seeded RNG)
    chain: Chain | None = None
    #: the node's say on a verified open before it takes a slot (opens per initiator: session/admission.py)
    admit: Callable[[pb.RouteOpen], None] | None = None
    #: the task serving this session's stream (a resume that supersedes it cancels it)
    task: asyncio.Task[object] | None = None
    #: an audit session (RouteOpen.audit): fed by the initiator, answers with seals, forwards nothing
    audit: bool = False
    #: hops from this one to the tail: the groups its decode steps are computed in (executor/api.py _Job)
    groups: int = 1
    #: steps computed in this session (LIE_EVERY counts them)
    computed: int = 0
    #: non-tail: after a draft step, the least position the next step may roll this hop back to
    draft_floor: int | None = None

    # -- open -----------------------------------------------------------------

    async def open(self, frame: pb.SessionFrame, prior: HopSession | None = None) -> pb.SessionAccepted:
        """Accept an open; with ``prior`` (a detached session of this id) adopt its KV state."""
        o = frame.open
        self.session_id, self.epoch, self.open_msg = o.route_session_id, o.route_epoch, o
        cap = self.capability
        if o.schema_version != SCHEMA_VERSION:
            raise errors.SchemaError(f"schema version {o.schema_version} is not {SCHEMA_VERSION}")
        left = codec.seconds_left(o.deadline_unix_nanos)
        if left is not None and left <= 0:
            raise errors.DeadlineError(f"the open arrived {-left:.3f}s past its deadline")
        if o.model_fingerprint != cap.model_fingerprint:
            raise errors.FingerprintMismatchError(
                f"this node serves model {cap.model_fingerprint[:12]}…, not {o.model_fingerprint[:12]}…"
            )
        if (o.range.start, o.range.end) != (cap.range.start, cap.range.end):
            raise errors.RangeMismatchError(
                f"this node serves layers {cap.range.start}:{cap.range.end}, not {o.range.start}:{o.range.end}"
            )
        if o.HasField("numerics") and codec.numerics_key(o.numerics) != codec.numerics_key(cap.numerics):
            raise errors.RouteError(f"numerics {o.numerics} differ from this node's {cap.numerics}")
        sampling = sampling_from_pb(o.sampling)
        if o.sampled and not o.resume:
            raise errors.InputError("only a resume carries sampled tokens")
        if o.wire_dtype not in NP_DTYPES and o.wire_dtype != pb.DTYPE_UNSPECIFIED:
            raise errors.ShapeError(f"wire dtype {o.wire_dtype} is not DTYPE_F32 or DTYPE_F16")
        self.route_open = check_open(o, own_node_id=self.ident.node_id, fingerprint=cap.model_fingerprint,
                                     start=cap.range.start, end=cap.range.end, now=int(time.time()),
                                     seen_nonces=self.nonces)
        self.audit = self.route_open.audit
        if self.audit and (o.downstream or o.resume):
            raise errors.RouteError("an audit session has no downstream hop and is never resumed")
        if not self.audit and bool(o.downstream) == (cap.range.end == cap.n_layer):
            raise errors.RouteError("a tail has no downstream hop and every other hop has one")
        if o.downstream and o.downstream[0].node_id != self.route_open.next_node_id:
            raise errors.OpenMismatchError("the next hop is not the one the signed open names")
        if self.admit is not None:
            self.admit(self.route_open)
        own = pb.FlowLimits(
            max_chunk_bytes=self.limits.max_chunk_bytes,
            max_prefill_chunk_tokens=min(self.limits.max_prefill_chunk_tokens, cap.numerics.n_batch),
            credits=self.limits.credits,
        )
        self.negotiated = negotiate(own, o.limits)
        if prior is not None:
            await self.adopt(prior, o)
        else:
            self.slot = self.executor.open_slot(o.slot_hint if o.HasField("slot_hint") else None)
        assert self.slot is not None
        if cap.range.end == cap.n_layer:  # an audited tail draws too: the initiator compares the tokens
            self.chain = self._rebuild_chain(sampling, o.sampled, o.n_past)
        hops = [cap]
        acceptances = [accept(self.ident, self.route_open)]
        cached = [self.executor.next_pos(self.slot)]
        self.groups = 1 + len(o.downstream)
        if o.downstream:
            accepted = await self._open_downstream(o)
            self.negotiated = negotiate(self.negotiated, accepted.limits)
            hops.extend(accepted.hops)
            acceptances.extend(accepted.acceptances)
            cached.extend(accepted.cached)

        return pb.SessionAccepted(
            route_session_id=o.route_session_id, route_epoch=o.route_epoch, limits=self.negotiated, hops=hops,
            acceptances=acceptances, cached=cached,
        )

    def _rebuild_chain(self, sampling: SamplingParams, sampled: Sequence[int], n_past: int) -> Chain:
        """The tail's sampler chain, advanced over the tokens sampled before a resume (none when new).

        Rebuilt on every resume, even when this tail adopts its own detached session: it may have
        sampled tokens whose results never reached the initiator, and a chain cannot be rolled back.
        """
        vocab = self.executor.vocab
        assert vocab is not None
        if len(sampled) > n_past + 1:
            raise errors.InputError(f"{len(sampled)} sampled tokens for a resume at position {n_past}")
        bad = [t for t in sampled if not 0 <= t < vocab.n_tokens]
        if bad:
            raise errors.InputError(f"sampled token {bad[0]} is outside the vocabulary of {vocab.n_tokens}")
        chain = Chain(sampling, vocab.n_tokens)
        for t in sampled:
            chain.advance(t)
        return chain

    async def adopt(self, prior: HopSession, o: pb.SessionOpen) -> None:
        """Take over a detached session's KV state, keeping positions [0, o.n_past)."""
        if prior.route_open.initiator_node_id != self.route_open.initiator_node_id:
            raise errors.OpenMismatchError(f"session {o.route_session_id} was opened by another initiator")
        if o.route_epoch <= prior.epoch:
            raise errors.EpochStaleError(f"a resume needs an epoch above {prior.epoch}, not {o.route_epoch}")
        assert prior.slot is not None
        self.slot, prior.slot = prior.slot, None
        if prior.chain is not None:  # open() builds this session's own, advanced to the resume point
            prior.chain.close()
            prior.chain = None
        await self.executor.truncate(self.slot, o.n_past)
        self.history = {p: r for p, r in prior.history.items() if p + len(r) <= o.n_past}

    async def _open_downstream(self, o: pb.SessionOpen) -> pb.SessionAccepted:
        nxt = o.downstream[0]
        nxt_open = parse_open(nxt.signed_open)  # the next hop checks it in full; this one needs it whole
        if nxt_open.initiator_node_id != self.route_open.initiator_node_id:
            raise errors.OpenForgedError("the next hop's open is signed by another initiator")
        # TLS pinned to the node the open names
        self.downstream = (link_stream(nxt.endpoint, nxt_open.hop_node_id) if self.limits.link
                           else FrameStream(nxt.endpoint, nxt_open.hop_node_id))
        fwd = pb.SessionOpen()
        fwd.CopyFrom(o)
        fwd.range.CopyFrom(nxt.range)
        del fwd.downstream[:]
        fwd.downstream.extend(o.downstream[1:])
        fwd.limits.CopyFrom(self.negotiated)
        fwd.signed_open.CopyFrom(nxt.signed_open)
        fwd.forwarder_proof.CopyFrom(forward_proof(self.ident, nxt_open))
        assert self.slot is not None
        fwd.slot_hint = self.slot  # the next hop's groups of sessions then match this one's (docs/protocol.md)
        frame = pb.SessionFrame(route_session_id=o.route_session_id, route_epoch=o.route_epoch, open=fwd)
        timeout = codec.seconds_left(o.deadline_unix_nanos) or self.limits.step_timeout
        reply = await self.downstream.exchange(frame, timeout)
        if reply.HasField("error"):
            raise codec.error_from_pb(reply.error)
        if not reply.HasField("accepted"):
            raise errors.PeerError("answered the open with something else", hop=nxt.endpoint)
        return reply.accepted

    # -- steps ------------------------------------------------------------------

    async def step(self, frame: pb.SessionFrame) -> pb.SessionReply:
        """One step, answered once every hop after this one has answered it."""
        return await (await self.start(frame))

    async def start(self, frame: pb.SessionFrame) -> Awaitable[pb.SessionReply]:
        """This hop's part of a step: checks, llama.cpp, the residual sent on downstream.

        Returns an awaitable of the step's reply, which waits for the next hop's
        answer: meanwhile this hop may start the session's next step (a prompt
        chunk *k + 1* here while the next hop computes chunk *k*). Await it once.
        """
        s = frame.step
        if frame.route_epoch != self.epoch:
            raise errors.EpochStaleError(f"route epoch {frame.route_epoch} is stale (session is at {self.epoch})")
        left = codec.seconds_left(s.deadline_unix_nanos)
        if left is not None and left <= 0:
            raise errors.DeadlineError(f"step {s.step_id} arrived {-left:.3f}s past its deadline")
        if s.step_id <= self.last_step_id:
            dup = pb.StepResult(step_id=s.step_id, duplicate=True)
            if self.last_result is not None and s.step_id == self.last_result.step_id:
                dup.CopyFrom(self.last_result)
                dup.duplicate = True
            return _ready(pb.SessionReply(route_session_id=self.session_id, result=dup))
        if s.work_id and s.work_id in self.cancelled_work:
            raise errors.CancelledError(f"work item {s.work_id} was cancelled")
        t0 = time.perf_counter_ns()
        rest = await self._execute(frame, left)
        self.last_step_id = s.step_id
        return self._answer(rest, t0)

    async def _answer(self, rest: Awaitable[pb.StepResult], t0: int) -> pb.SessionReply:
        result = await rest
        result.timings[0].handle_nanos = time.perf_counter_ns() - t0
        if result.step_id == self.last_step_id:
            self.last_result = result
        return pb.SessionReply(route_session_id=self.session_id, result=result)

    async def _execute(self, frame: pb.SessionFrame, left: float | None) -> Awaitable[pb.StepResult]:
        s = frame.step
        assert self.slot is not None
        assert self.open_msg is not None
        ex = self.executor
        n_past = ex.next_pos(self.slot)
        if s.replay and s.cache.n_past < n_past:
            return await self._replay_cached(frame, left)
        if rollback_to(s.cache.n_past, n_past, self.draft_floor):  # drafted positions that did not stand
            await self._roll_back(s.cache.n_past)
            n_past = s.cache.n_past
        self.draft_floor = None
        if s.cache.n_past != n_past:
            raise errors.CacheMissError(f"step expects {s.cache.n_past} cached positions; this hop holds {n_past}")
        if s.draft:
            return await self._draft(frame, n_past, left)
        tokens = embd = None
        wire = self.open_msg.wire_dtype or pb.DTYPE_F32
        if ex.takes_tokens:
            if s.HasField("activation") or not s.tokens:
                raise errors.ShapeError("this hop is the head: a step must carry token ids")
            tokens = np.asarray(s.tokens, dtype=np.int32)
            n = len(tokens)
            digest_in = tokens_digest(tokens)
        else:
            if not s.HasField("activation"):
                raise errors.ShapeError("this hop takes a residual: a step must carry an activation")
            embd = decode_bundle(s.activation, n_cols=ex.n_embd, max_chunk_bytes=self.negotiated.max_chunk_bytes)
            n = embd.shape[0]
            if s.activation.pos_start != n_past:
                raise errors.CacheMissError(f"activation starts at position {s.activation.pos_start}, not {n_past}")
            digest_in = rows_digest(embd, wire)
        if n > self.negotiated.max_prefill_chunk_tokens:
            raise errors.ShapeError(f"step carries {n} tokens; the negotiated maximum is "
                                    f"{self.negotiated.max_prefill_chunk_tokens}")
        timed = await ex.forward(self.slot, n_past, tokens=tokens, embd=embd, groups=self.groups)
        timing = pb.HopTiming(endpoint=self.endpoint, compute_nanos=timed.compute_nanos, n_tokens=n,
                              bytes_in=s.activation.total_bytes if embd is not None else 4 * n)
        out = timed.output
        self.computed += 1
        if out.residual is not None:
            residual = self._maybe_lie(out.residual)
            seal = functools.partial(self._seal_rows, s.step_id, n_past, n, digest_in, residual, wire)
            if self.audit:
                timing.seal.CopyFrom(seal())
                return _ready(pb.StepResult(step_id=s.step_id, timings=[timing]))
            self.history[n_past] = residual
            return await self._forward(frame, residual, n_past, timing, left, seal)
        assert out.logits is not None
        tok = None
        if s.sample and not s.replay:  # a replay rebuilt this hop's KV: its token was drawn before the failover
            assert self.chain is not None
            tok = self._maybe_misdraw(self.chain.sample(out.logits))  # llama.cpp's chain; its state moves on
        timing.seal.CopyFrom(self._seal(s.step_id, n_past, n, digest_in, logits_digest(out.logits), token=tok))
        result = pb.StepResult(step_id=s.step_id, timings=[timing])  # (a copy of timing: sealed first)
        if s.replay or self.audit:
            return _ready(result)
        if tok is not None:
            vocab = ex.vocab
            assert vocab is not None
            result.token = tok
            result.piece = vocab.piece(tok)
            result.end_of_generation = vocab.is_eog(tok)
        if self.open_msg.return_logits:
            result.logits.CopyFrom(encode_bundle(out.logits[None, :], max_chunk_bytes=1 << 30))
        return _ready(result)

    async def _draft(self, frame: pb.SessionFrame, n_past: int, left: float | None) -> Awaitable[pb.StepResult]:
        """A draft step (session/drafts.py): its positions one at a time; the tail samples while drafts stand."""
        s = frame.step
        ex = self.executor
        assert self.open_msg is not None
        assert self.slot is not None
        if self.audit or s.replay:
            raise errors.SessionError("a draft step goes to a route session, never replayed")
        wire = self.open_msg.wire_dtype or pb.DTYPE_F32
        embd = None if ex.takes_tokens else decode_bundle(s.activation, n_cols=ex.n_embd,
                                                          max_chunk_bytes=self.negotiated.max_chunk_bytes)
        if embd is not None and s.activation.pos_start != n_past:
            raise errors.CacheMissError(f"activation starts at position {s.activation.pos_start}, not {n_past}")
        check_draft(len(s.tokens), s.draft, None if embd is None else embd.shape[0],
                    most=self.negotiated.max_prefill_chunk_tokens)
        toks = np.asarray(s.tokens, dtype=np.int32)
        digest_in = tokens_digest(toks) if embd is None else rows_digest(embd, wire)
        timing = pb.HopTiming(endpoint=self.endpoint, n_tokens=len(toks),
                              bytes_in=s.activation.total_bytes if embd is not None else 4 * len(toks))
        self.computed += 1
        if self.downstream is not None:
            rows = []
            for i in range(len(toks)):
                timed = await ex.forward(self.slot, n_past + i, tokens=toks[i:i + 1] if embd is None else None,
                                         embd=None if embd is None else embd[i:i + 1], groups=self.groups)
                timing.compute_nanos += timed.compute_nanos
                assert timed.output.residual is not None
                rows.append(timed.output.residual)
            residual = np.concatenate(rows)
            seal = functools.partial(self._seal_rows, s.step_id, n_past, len(toks), digest_in, residual, wire)
            self.history[n_past] = residual
            self.draft_floor = n_past + 1
            return await self._forward(frame, residual, n_past, timing, left, seal)
        assert embd is not None
        assert self.chain is not None
        vocab = ex.vocab
        assert vocab is not None
        sampled: list[int] = []
        logits: list[np.ndarray] = []
        for i in range(len(toks)):
            timed = await ex.forward(self.slot, n_past + i, embd=embd[i:i + 1], groups=self.groups)
            timing.compute_nanos += timed.compute_nanos
            assert timed.output.logits is not None
            logits.append(timed.output.logits)
            sampled.append(self.chain.sample(timed.output.logits))
            if not stands(i, sampled[-1], s.tokens, vocab.is_eog(sampled[-1])):
                break
        timing.seal.CopyFrom(self._seal(s.step_id, n_past, len(sampled), digest_in, logits_digest(logits[-1]),
                                        token=sampled[-1]))
        result = pb.StepResult(step_id=s.step_id, timings=[timing], tokens=sampled,
                               pieces=[vocab.piece(t) for t in sampled], token=sampled[-1],
                               piece=vocab.piece(sampled[-1]), end_of_generation=vocab.is_eog(sampled[-1]))
        if self.open_msg.return_logits:
            result.logits.CopyFrom(encode_bundle(np.stack(logits), max_chunk_bytes=1 << 30))
        return _ready(result)

    async def _roll_back(self, n_past: int) -> None:
        """Drop positions from ``n_past`` on (drafts that did not stand), and their stored rows."""
        assert self.slot is not None
        await self.executor.truncate(self.slot, n_past)
        for p in [p for p in self.history if p + len(self.history[p]) > n_past]:
            rows = self.history.pop(p)
            if p < n_past:
                self.history[p] = rows[: n_past - p]

    def _seal(self, step_id: int, pos: int, n: int, digest_in: bytes, digest_out: bytes, *,
              replayed: bool = False, token: int | None = None) -> pb.SignedEnvelope:
        assert self.open_msg is not None
        return sign_step(self.ident, self.capability, session_id=self.session_id, epoch=self.epoch, step_id=step_id,
                         pos_start=pos, n_tokens=n, wire_dtype=self.open_msg.wire_dtype, input_sha256=digest_in,
                         output_sha256=digest_out, replayed=replayed, token=token)

    def _seal_rows(self, step_id: int, pos: int, n: int, digest_in: bytes, rows: np.ndarray,
                   wire: int) -> pb.SignedEnvelope:
        """The seal of a step whose output is ``rows`` (a residual passed on)."""
        return self._seal(step_id, pos, n, digest_in, rows_digest(rows, wire))

    def _maybe_lie(self, residual: np.ndarray) -> np.ndarray:
        """Tests only (``MESHNODE_TEST_LIE_EVERY``): every Nth computed step, one value one ulp off."""
        if not LIE_EVERY or self.audit or self.computed % LIE_EVERY:
            return residual
        lied = residual.copy()
        lied[-1, 0] = np.nextafter(lied[-1, 0], np.float32(np.inf))
        return lied

    def _maybe_misdraw(self, token: int) -> int:
        """Tests only (``MESHNODE_TEST_LIE_EVERY`` at a tail): every Nth computed step, the next token id."""
        if not LIE_EVERY or self.audit or self.computed % LIE_EVERY:
            return token
        vocab = self.executor.vocab
        assert vocab is not None
        return (token + 1) % vocab.n_tokens

    async def _replay_cached(self, frame: pb.SessionFrame, left: float | None) -> Awaitable[pb.StepResult]:
        """A replay step for positions this hop holds: pass the stored rows on (tail: acknowledge)."""
        s = frame.step
        pos = s.cache.n_past
        wire = (self.open_msg.wire_dtype if self.open_msg is not None else 0) or pb.DTYPE_F32
        if self.executor.takes_tokens:
            n = len(s.tokens)
            digest_in = tokens_digest(s.tokens)
        else:
            embd = decode_bundle(s.activation, n_cols=self.executor.n_embd,
                                 max_chunk_bytes=self.negotiated.max_chunk_bytes)
            n = embd.shape[0]
            digest_in = rows_digest(embd, wire)
            if s.activation.pos_start != pos:
                raise errors.CacheMissError(f"activation starts at position {s.activation.pos_start}, not {pos}")
        if n < 1:
            raise errors.ShapeError("a replay step carries no positions")
        timing = pb.HopTiming(endpoint=self.endpoint, n_tokens=n)
        if self.downstream is None:
            return _ready(pb.StepResult(step_id=s.step_id, timings=[timing]))
        rows = self.history.get(pos)
        if rows is None or len(rows) != n:
            raise errors.CacheMissError(f"no stored output for a {n}-position chunk at position {pos}; replay "
                                        "must repeat the session's original chunking")
        timing.seal.CopyFrom(self._seal(s.step_id, pos, n, digest_in, rows_digest(rows, wire), replayed=True))
        return await self._forward(frame, rows, pos, timing, left)

    def outputs(self, start: int, end: int) -> list[pb.TensorBundle]:
        """The rows this (non-tail) hop sent on for the chunks within positions [start, end) (0: no
        end), in position order, as the wire payloads it sent: what an audit feeds a replica of the
        next hop (docs/security.md, "A hop that lies")."""
        assert self.open_msg is not None
        wire = self.open_msg.wire_dtype or pb.DTYPE_F32
        return [encode_bundle(rows, dtype=wire, pos_start=p, max_chunk_bytes=self.negotiated.max_chunk_bytes)
                for p, rows in sorted(self.history.items()) if p >= start and (not end or p + len(rows) <= end)]

    async def _forward(self, frame: pb.SessionFrame, residual: np.ndarray, n_past: int, timing: pb.HopTiming,
                       left: float | None, seal: Callable[[], pb.SignedEnvelope] | None = None
                       ) -> Awaitable[pb.StepResult]:
        """Send the residual on; returns the awaitable of the next hop's result (with this hop's timing).

        ``seal``: this hop's seal of the step, signed once the residual is on its way (the signature
        then costs the next hop's compute time, not the token's path); it travels back in ``timing``
        with the next hop's answer, as before.
        """
        assert self.downstream is not None
        assert self.open_msg is not None
        s = frame.step
        if s.replay and s.replay_hops == 1:  # no hop further on lacks these positions
            if seal is not None:
                timing.seal.CopyFrom(seal())
            return _ready(pb.StepResult(step_id=s.step_id, timings=[timing]))
        bundle = encode_bundle(residual, dtype=self.open_msg.wire_dtype or pb.DTYPE_F32, pos_start=n_past,
                               max_chunk_bytes=self.negotiated.max_chunk_bytes)
        fwd = pb.Step(step_id=s.step_id, work_id=s.work_id, cache=s.cache, activation=bundle,
                      sample=s.sample and not s.replay, deadline_unix_nanos=codec.sooner(s.deadline_unix_nanos),
                      replay=s.replay,
                      replay_hops=max(s.replay_hops - 1, 0), draft=s.draft, tokens=s.tokens if s.draft else [])
        down = self.downstream
        reply = await down.send(pb.SessionFrame(route_session_id=self.session_id, route_epoch=self.epoch, step=fwd))
        return self._downstream_result(down, reply, timing, left, seal)

    async def _downstream_result(self, down: FrameStream, fut: asyncio.Future[pb.SessionReply],
                                 timing: pb.HopTiming, left: float | None,
                                 seal: Callable[[], pb.SignedEnvelope] | None = None) -> pb.StepResult:
        if seal is not None:  # once the residual's write has started (one turn of the loop): off the token's path
            await asyncio.sleep(0)
            timing.seal.CopyFrom(seal())  # before the answer is taken: timing goes back with it
        reply = await down.wait(fut, left if left is not None else self.limits.step_timeout)
        if reply.HasField("error"):
            raise codec.error_from_pb(reply.error)
        if not reply.HasField("result"):
            raise errors.PeerError("answered a step with something else", hop=down.endpoint)
        result = reply.result
        result.timings.insert(0, timing)
        return result

    # -- delegated decode (head only) ---------------------------------------------

    async def generate(self, frame: pb.SessionFrame, post: Callable[[pb.SessionReply], None],
                       stop: asyncio.Event, flow: Flow | None = None) -> None:
        """Run a Generate: one ordinary step per token, each result posted upstream.

        ``post`` queues a result for sending and returns at once; a result is
        posted only once the next token's step has been computed here and sent
        on, so its write to the initiator (grpc's socket work on this thread)
        happens while the next hop computes, not between the last hop's answer
        and this hop's next decode. ``post`` raises once the upstream stream broke.

        Stops at end-of-generation, ``max_tokens`` or when ``stop`` is set
        (in-band cancel); the last result written has ``last = true``. A failing
        step raises after the results before it were written. With ``flow``, each
        step first takes a result credit (it pauses while the initiator has
        acknowledged too few results).
        """
        g = frame.generate
        if not self.executor.takes_tokens:
            raise errors.SessionError("Generate goes to the head of a route")
        if g.max_tokens < 1:
            raise errors.InputError("a Generate must ask for at least one token (max_tokens >= 1)")
        if g.first_step_id + g.max_tokens - 1 > UINT64:
            raise errors.InputError(f"step ids {g.first_step_id}..+{g.max_tokens} do not fit a uint64 step id")
        token, n_past = g.token, g.n_past
        # a step may take at most an hour: a larger timeout (up to 2**64 ns) is clamped, never overflows
        timeout_ns = min(g.step_timeout_nanos or int(self.limits.step_timeout * 1e9), MAX_STEP_TIMEOUT_NS)
        held: pb.SessionReply | None = None  # the last result, posted once the next step is on its way
        try:
            for i in range(g.max_tokens):
                if flow is not None:
                    if held is not None and flow.would_wait():
                        post(held)  # the initiator acknowledges what it has seen: never hold what it waits for
                        held = None
                    if not await flow.take(stop):
                        return  # cancelled or released while paused for credits
                step = pb.Step(step_id=g.first_step_id + i, work_id=g.work_id, tokens=[token], sample=True,
                               cache=pb.CacheExpectation(n_past=n_past),
                               deadline_unix_nanos=codec.now_ns() + timeout_ns)
                frame_i = pb.SessionFrame(route_session_id=self.session_id, route_epoch=self.epoch, step=step)
                try:
                    rest = await self.start(frame_i)
                except BaseException:
                    if flow is not None:
                        flow.refund()  # no result went out for it
                    raise
                if held is not None:
                    try:
                        post(held)  # written while the next hop computes this step: off the token's path
                    except errors.MeshnodeError:
                        held = None
                        with contextlib.suppress(Exception):
                            await rest  # the upstream is gone; collect what is owed downstream, then end
                        raise
                    held = None
                try:
                    reply = await rest
                except BaseException:
                    if flow is not None:
                        flow.refund()
                    raise
                result = reply.result
                result.last = result.end_of_generation or i == g.max_tokens - 1 or stop.is_set()
                if result.last:
                    post(reply)
                    return
                held = reply
                token, n_past = result.token, n_past + 1
        finally:
            if held is not None:
                post(held)  # the results before a failing step still go out first

    # -- control ------------------------------------------------------------------

    async def relay(self, frame: pb.SessionFrame) -> None:
        """Pass a control frame (credit, cancel, release) on downstream, best effort."""
        if self.downstream is not None:
            kind = frame.WhichOneof("body")
            if kind == "release" or (kind == "cancel" and not frame.cancel.work_id):
                self.downstream_told = True
            with contextlib.suppress(errors.MeshnodeError):
                await self.downstream.exchange(frame, self.limits.step_timeout)

    async def detach(self) -> None:
        """The stream broke: close downstream, keep the KV slot for a resume."""
        if self.downstream is not None:
            down, self.downstream = self.downstream, None
            await down.close()

    async def close(self, *, end_downstream: bool = True) -> None:
        """Free the KV slot and the downstream stream. Idempotent.

        With ``end_downstream`` the session is over for good, so the hops after this one are told
        (a release, best effort, bounded) unless a release or cancel already went down: merely
        hanging up on them would leave them holding its KV detached, waiting for a resume that never
        comes. Without it they only see the stream break (and keep the KV for a resume).
        """
        self.history.clear()
        if self.chain is not None:
            chain, self.chain = self.chain, None
            chain.close()
        if end_downstream and self.downstream is not None and not self.downstream_told:
            self.downstream_told = True
            with contextlib.suppress(errors.MeshnodeError):
                await self.downstream.exchange(pb.SessionFrame(
                    route_session_id=self.session_id, route_epoch=self.epoch, release=pb.ReleaseSignal()),
                    min(self.limits.step_timeout, RELEASE_TIMEOUT))
        await self.detach()
        if self.slot is not None:
            slot, self.slot = self.slot, None
            await self.executor.release(slot)
