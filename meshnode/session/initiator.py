"""The initiator side of a route session: check the route, prefill, decode, release.

``generate`` is one asyncio coroutine (run from trio through
``AioThread.run``, transport/aiothread.py): the per-token loop crosses no
trio<->asyncio boundary. Every step carries a deadline, and every read waits at most until
it, so a dead hop surfaces as a typed error naming it, never a hang.

Failover: the initiator keeps the session's history (the chunks it fed, in
their original chunking: prompt chunks, then one token per step). When a hop
fails and a spare peer serves its span, ``_fail_over`` swaps that span only,
reopens the route with ``resume`` under the next epoch (the other hops keep
their KV state) and replays the history from the lowest position some hop
lacks; the replaced hop recomputes it in the original chunking, so its KV
cache — and every later token — is bit-identical to an uninterrupted run.
The resume open also carries every token sampled so far (``sampled``): the
tail rebuilds its llama.cpp sampler chain from them (penalty window and RNG),
so the continuation is the uninterrupted run's at any temperature.

The text is cut as ``Llama.create_completion`` cuts it (``completion.py``:
end-of-generation, stop strings, max_tokens).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import trio

from meshnode import errors
from meshnode.audit.auditor import Auditor
from meshnode.audit.evidence import write_evidence
from meshnode.audit.policy import DEFAULT_AUDIT, AuditPolicy, Ledger
from meshnode.discovery.tracker_client import report_evidence
from meshnode.drafting import DraftLength, can_draft, propose
from meshnode.drafting.model import PROBE, ModelDrafter
from meshnode.executor.context import check_fits
from meshnode.gguf.model import check_file
from meshnode.identity import NodeIdentity, load_or_create
from meshnode.identity.attest import check_attested
from meshnode.identity.routeauth import HopPlan, check_acceptances, sign_control, sign_route
from meshnode.proto import node_pb2 as pb
from meshnode.routing.chain import PeerView, check_chain
from meshnode.routing.choose import Candidate
from meshnode.routing.failover import Backoff, can_fail_over, replacement, replay_depths, spare_candidates
from meshnode.routing.overlap import overcommitted
from meshnode.runtime.paths import state_dir
from meshnode.session.completion import Completion
from meshnode.session.profile import RouteClock
from meshnode.session.sampling import GREEDY, SamplingParams, check_sampling, check_stops
from meshnode.session.sampling import to_pb as sampling_pb
from meshnode.transport.client import get_capability, release, tokenize_chat, tokenize_with_bos
from meshnode.transport.stream import FrameStream
from meshnode.wire import codec
from meshnode.wire.schema import SCHEMA_VERSION
from meshnode.wire.tensors import decode_bundle, encode_bundle

log = logging.getLogger("meshnode.initiator")
#: re-routes one generation may make before it gives up
MAX_FAILOVERS = 4
#: seconds an abandoned session's out-of-band Release may take
ABANDON_TIMEOUT = 2.0
#: seconds a generation waits at its end for reports of caught lies to reach their trackers
REPORT_TIMEOUT = 120.0


async def _report_to(url: str, env: pb.SignedEnvelope) -> None:
    try:  # the tracker client is trio's (httpx under trio): a thread of its own, off the data path
        verdict = await asyncio.to_thread(trio.run, report_evidence, url, env, REPORT_TIMEOUT)
        log.error("tracker %s on the evidence: %s", url, verdict)
    except Exception as e:  # a report is best effort: the evidence is kept in the state dir
        log.warning("could not report the evidence to %s: %s", url, e)


@dataclass(frozen=True)
class GenerateConfig:
    #: raw completion text, tokenized by the tail as llama.cpp does by default (unused with ``messages``)
    prompt: str
    #: stop after this many generated tokens (or at end-of-generation); 0: as many as the context leaves
    max_tokens: int = 32
    #: the tail's llama.cpp sampler chain; greedy by default here (reproducible), the CLI passes its own
    sampling: SamplingParams = GREEDY
    #: stop strings: the text is cut before the first one that occurs, as ``Llama.create_completion`` cuts it
    stop: tuple[str, ...] = ()
    #: residual dtype on the wire: DTYPE_F32 (bit-exact) or DTYPE_F16 (not bit-exact)
    wire_dtype: int = pb.DTYPE_F32
    #: seconds each step may take end to end
    step_timeout: float = 30.0
    #: ask the tail for each step's logits (tests and parity checks)
    return_logits: bool = False
    #: delegated decode: the head runs the decode loop (Generate); False = one Step per token from here
    delegate: bool = True
    #: prefill with several prompt chunks in flight (the negotiated credits), so the hops compute
    #: different chunks at once, unless that would run more threads than cores (routing/overlap.py);
    #: False = one chunk at a time. Same chunks either way (bit-identical)
    pipeline: bool = True
    #: when a failed hop has no spare: seconds to wait for it to come back (a restart), then replay
    rejoin_wait: float = 5.0
    #: chat: (role, content) messages, rendered by the tail with the model's own chat template as
    #: ``Llama.create_chat_completion`` renders them (then ``prompt`` is not used)
    messages: tuple[tuple[str, str], ...] = ()
    #: spot checks of the route's hops against replicas (docs/security.md, "A hop that lies")
    audit: AuditPolicy = DEFAULT_AUDIT
    #: trackers to report a caught lie to (the evidence, signed by this initiator)
    report_to: tuple[str, ...] = ()
    #: speculative decoding: "" (off), "ngram" (prompt lookup: drafts from the prompt and the text so
    #: far, no model) or "model" (``model_draft`` run whole here). The text is the text without drafting;
    #: an audited session does not draft
    draft: str = ""
    #: the draft model's GGUF (with ``draft="model"``); its vocabulary must be the route's
    model_draft: str = ""
    #: the most tokens drafted per step (fewer while drafts fail: drafting/length.py), ``--draft-max``
    draft_max: int = 8


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: list[int]
    stop_reason: str  # "eog" | "stop" (a stop string) | "length"
    prefill_seconds: float
    decode_seconds: float
    route: list[str]
    #: with return_logits: the logits each token was sampled from, one row per token
    logits: list[np.ndarray] = field(default_factory=list)
    #: wire bytes received per hop per decoded token (activation payloads)
    bytes_per_token: dict[str, float] = field(default_factory=dict)
    #: re-routes made (``Failover`` as dicts), in order
    failovers: list[dict[str, object]] = field(default_factory=list)
    #: the dist sampler's seed (None: greedy, no seed involved)
    seed: int | None = None
    #: spot checks: whether this session was audited, which hops by which replica, lies caught
    audit: dict[str, object] = field(default_factory=dict)
    #: speculative decoding: steps that drafted, tokens drafted and accepted (empty: no drafting)
    draft: dict[str, int] = field(default_factory=dict)
    #: where a decoded token's time went, per hop (session/profile.py)
    hops: dict[str, object] = field(default_factory=dict)
    #: the route that finished the answer, head first: endpoint, node id and layers [start, end) of each hop
    route_hops: list[dict[str, object]] = field(default_factory=list)

    def decode_tokens_per_second(self) -> float | None:
        """Decoded tokens a second after the first (which the prefill made); None with fewer than two."""
        n = len(self.tokens)
        return (n - 1) / self.decode_seconds if n > 1 and self.decode_seconds > 0 else None


@dataclass
class Failover:
    """One re-route: which hop failed, who took over, what it cost."""

    hop: str
    layers: str
    error: str
    replacement: list[str]
    #: positions replayed through the new route
    replayed_positions: int
    #: seconds from seeing the failure to the route being whole again
    recovery_seconds: float
    #: seconds from seeing the failure to the next token (None if none came)
    seconds_to_next_token: float | None = None
    detected_at: float = 0.0


def peer_view(endpoint: str, cap: pb.Capability) -> PeerView:
    return PeerView(endpoint, cap.model_fingerprint, cap.n_layer, cap.range.start, cap.range.end,
                    codec.numerics_key(cap.numerics))


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
        #: chunks fed whose results arrived, in order (positions [0, n_past)): what a failover replays
        self.history: list[list[int]] = []
        #: every token the tail sampled whose result arrived, in order: a resume rebuilds the tail's sampler
        self.sampled: list[int] = []
        self.limits = pb.FlowLimits()
        #: Generate results read and not yet acknowledged with a CreditGrant
        self._owed = 0
        self._stream = FrameStream(peers[0], self.caps[0].node_id)
        #: keeps every step's seals when the session is audited
        self.auditor: Auditor | None = None

    async def _write(self, frame: pb.SessionFrame) -> None:
        await self._stream.write(frame)

    async def _exchange(self, frame: pb.SessionFrame) -> pb.SessionReply:
        await self._write(frame)
        return await self._read()

    async def _read(self) -> pb.SessionReply:
        # the hops give up on a silent hop at the step's deadline, each sooner than the one before it
        # (codec.sooner): their error, naming the silent hop, must arrive before this read gives up
        # and blames the head
        reply = await self._stream.read(self.cfg.step_timeout * 1.25 + 0.5)
        if reply.HasField("error"):
            raise codec.error_from_pb(reply.error)
        if self.auditor is not None and reply.HasField("result"):
            self.auditor.record(reply.result)
        return reply

    async def open(self, *, resume: bool = False) -> pb.SessionAccepted:
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
            sampling=sampling_pb(self.cfg.sampling), numerics=head.numerics, return_logits=self.cfg.return_logits,
            deadline_unix_nanos=codec.deadline_in(self.cfg.step_timeout), resume=resume,
            n_past=self.n_past if resume else 0, sampled=self.sampled if resume else [],
        )
        reply = await self._exchange(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, open=o))
        if not reply.HasField("accepted"):
            raise errors.PeerError("answered the open with something else", hop=self.peers[0])
        check_acceptances(list(reply.accepted.acceptances), opens, plans)
        self.limits = reply.accepted.limits
        return reply.accepted

    async def step(self, tokens: Sequence[int], *, sample: bool) -> pb.StepResult:
        return self._took(await self._step(tokens, self.n_past, sample=sample), tokens)

    async def draft_step(self, tokens: Sequence[int]) -> pb.StepResult:
        """One draft step: ``tokens`` are the last sampled token and the drafts (session/drafts.py). The
        result's ``tokens`` are the tail's samples: the drafts that stood, then the next token; the
        positions that stood are held by every hop from here on (the next step drops the rest)."""
        self.step_id += 1
        s = pb.Step(step_id=self.step_id, tokens=list(tokens), sample=True, draft=len(tokens) - 1,
                    cache=pb.CacheExpectation(n_past=self.n_past),
                    deadline_unix_nanos=codec.deadline_in(self.cfg.step_timeout))
        await self._write(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, step=s))
        result = await self._answer(self.step_id)
        n = len(result.tokens)
        if not 1 <= n <= len(tokens) or list(result.tokens[:-1]) != list(tokens[1:n]) or len(result.pieces) != n:
            raise errors.PeerError(f"answered a draft of {len(tokens) - 1} tokens with samples that do not follow "
                                   "the drafts", hop=self.peers[-1])
        return self._took(result, tokens[:n])

    async def prefill(self, chunks: Sequence[Sequence[int]], *, window: int | None = None) -> pb.StepResult:
        """Feed prompt chunks with up to ``window`` unanswered at once (default: the negotiated
        credits), so hop *i + 1* computes chunk *k* while hop *i* computes chunk *k + 1*; the last
        chunk samples. Every chunk is the step it would be alone (same chunking, so the same
        numerics); only the waiting overlaps. Returns the last chunk's result.
        """
        window = max(window or self.limits.credits or len(chunks), 1)
        unanswered: collections.deque[tuple[int, Sequence[int]]] = collections.deque()  # (step id, chunk)
        pos, result = self.n_past, None
        for i, chunk in enumerate(chunks):
            if len(unanswered) >= window:
                step_id, done = unanswered.popleft()
                result = self._took(await self._answer(step_id), done)
            unanswered.append((await self._send_step(chunk, pos, sample=i == len(chunks) - 1), chunk))
            pos += len(chunk)
        while unanswered:
            step_id, done = unanswered.popleft()
            result = self._took(await self._answer(step_id), done)
        if result is None:
            raise errors.InputError("no prompt chunks to feed")
        return result

    def _took(self, result: pb.StepResult, chunk: Sequence[int]) -> pb.StepResult:
        """A chunk's result arrived: its positions are held by every hop (what a failover replays)."""
        self.n_past += len(chunk)
        self.history.append(list(chunk))
        return result

    async def _step(self, tokens: Sequence[int], pos: int, *, sample: bool, replay: int = 0) -> pb.StepResult:
        """One step; ``replay`` > 0: a replay that must reach that many hops."""
        return await self._answer(await self._send_step(tokens, pos, sample=sample, replay=replay))

    async def _send_step(self, tokens: Sequence[int], pos: int, *, sample: bool, replay: int = 0) -> int:
        self.step_id += 1
        s = pb.Step(step_id=self.step_id, tokens=list(tokens), sample=sample, replay=replay > 0, replay_hops=replay,
                    cache=pb.CacheExpectation(n_past=pos),
                    deadline_unix_nanos=codec.deadline_in(self.cfg.step_timeout))
        await self._write(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, step=s))
        return self.step_id

    async def _answer(self, step_id: int) -> pb.StepResult:
        reply = await self._read()
        if not reply.HasField("result") or reply.result.step_id != step_id:
            raise errors.PeerError(f"answered step {step_id} with something else", hop=self.peers[0])
        return reply.result

    async def resume(self, peers: Sequence[str], caps: Sequence[pb.Capability]) -> int:
        """Reopen on ``peers`` under the next epoch, keeping hops' KV state; replay what some hop lacks.

        Returns the number of positions replayed.
        """
        await self.close()
        self.peers, self.caps = list(peers), list(caps)
        self.epoch += 1
        self._owed = 0
        self._stream = FrameStream(self.peers[0], self.caps[0].node_id)
        t0 = time.perf_counter()
        accepted = await self.open(resume=True)
        log.info("resumed route open in %.3fs; hops hold %s positions", time.perf_counter() - t0,
                 list(accepted.cached))
        if len(accepted.cached) != len(self.peers):
            raise errors.PeerError(f"the resumed open reports {len(accepted.cached)} hops' caches, "
                                   f"not {len(self.peers)}", hop=self.peers[0])
        pos = replayed = 0
        for chunk, depth in zip(self.history, replay_depths([len(c) for c in self.history], accepted.cached),
                                strict=True):
            if depth:
                await self._step(chunk, pos, sample=False, replay=depth)
                replayed += len(chunk)
            pos += len(chunk)
        return replayed

    async def generate(self, token: int, max_tokens: int) -> AsyncIterator[pb.StepResult]:
        """Delegated decode: the head loops; yields one result per generated token."""
        g = pb.Generate(first_step_id=self.step_id + 1, token=token, n_past=self.n_past, max_tokens=max_tokens,
                        step_timeout_nanos=int(self.cfg.step_timeout * 1e9))
        await self._write(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch, generate=g))
        fed = token
        while True:
            reply = await self._read()
            if not reply.HasField("result") or reply.result.step_id != self.step_id + 1:
                raise errors.PeerError(f"answered step {self.step_id + 1} with something else", hop=self.peers[0])
            self.step_id += 1
            self.n_past += 1
            self.history.append([fed])
            fed = reply.result.token
            if reply.result.last:
                # every result took a credit of the head's window, the last too: give them all back,
                # so a later Generate of this session (drafting rests in stretches) starts with a full one
                await self._acknowledge(settle=True)
                yield reply.result
                return
            await self._acknowledge()
            yield reply.result
            if reply.result.last:
                return

    async def _acknowledge(self, *, settle: bool = False) -> None:
        """Return a Generate's result credits to the head, half a window at a time (``settle``: all owed)."""
        self._owed += 1
        credits = self.limits.credits
        if credits and (settle or self._owed >= max(credits // 2, 1)):
            owed, self._owed = self._owed, 0
            await self._write(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch,
                                              credit=pb.CreditGrant(credits=owed)))

    async def release(self) -> None:
        """Release the session and wait for its answer. A Generate stopped early (a stop string) may
        still have results on the way: they are read past (each read bounded by the step timeout)."""
        try:
            await self._write(pb.SessionFrame(route_session_id=self.id, route_epoch=self.epoch,
                                              release=pb.ReleaseSignal()))
            while (await self._read()).HasField("result"):
                pass
        finally:
            await self.close()

    async def close(self) -> None:
        await self._stream.close()

    async def abandon(self, timeout: float = ABANDON_TIMEOUT) -> None:
        """Give the session up for good (the user stopped it) and free its KV on every hop now, not
        after the hops' detach grace: an out-of-band Release, signed by this initiator, to each hop
        at once (the session stream is gone by then: grpc cancels a call whose read is cancelled).
        Best effort, bounded by ``timeout``; then hang up."""
        auth = sign_control(self.ident, self.id, "release", now=int(time.time()))

        async def one(endpoint: str) -> None:
            with contextlib.suppress(errors.MeshnodeError):  # the RPC's own deadline bounds it
                await release(endpoint, self.id, auth, timeout)

        try:
            await asyncio.gather(*(one(p) for p in self.peers))
        finally:
            await self.close()


async def generate(peers: Sequence[str], cfg: GenerateConfig, ident: NodeIdentity | None = None, *,
                   spares: Sequence[str] = (),
                   on_token: OnToken | None = None, ledger: Ledger | None = None) -> GenerationResult:
    """Generate across the route ``peers`` (in layer order).

    ``spares``: other peers of the same model; when a hop fails, one of them
    (or a chain of them) that serves its span takes over. ``on_token`` is
    called with each token id and the text bytes it releases as it arrives
    (``completion.Completion.release``: text that may start a stop string is
    held back; a last call with token None flushes what was held at the end).
    """
    check_generate(cfg)
    caps = await check_route(peers)
    spare_caps = await _spare_capabilities([s for s in spares if s not in peers], caps[0])
    prompt, bos, cfg = await _prompt(peers[-1], cfg, caps[-1].node_id)  # the tail carries the vocabulary
    # the route's context is its smallest hop's (hops may differ: it is not a numerics setting)
    ctx, smallest = min((c.numerics.n_ctx_per_session, p) for p, c in zip(peers, caps, strict=True))
    if cfg.max_tokens == 0:
        cfg = replace(cfg, max_tokens=max(ctx - len(prompt), 1))
    check_fits(len(prompt), cfg.max_tokens, ctx, where=f" of hop {smallest}, the route's smallest")
    spare_caps = {e: c for e, c in spare_caps.items()
                  if c.numerics.n_ctx_per_session >= len(prompt) + cfg.max_tokens}
    rs = RouteSession(peers, caps, cfg, ident)
    ledger = ledger or Ledger(state_dir())
    if ledger.audited([c.node_id for c in caps], cfg.audit, random.Random()):
        rs.auditor = Auditor(rs.ident, every=cfg.audit.every, wire_dtype=cfg.wire_dtype, step_timeout=cfg.step_timeout,
                             sampling=sampling_pb(cfg.sampling))
    limit = caps[0].numerics.n_ctx_per_session - len(prompt)
    run: _Run | None = None
    drafter: ModelDrafter | None = None
    try:
        if cfg.draft == "model":
            drafter = await asyncio.to_thread(ModelDrafter, Path(cfg.model_draft), len(prompt) + cfg.max_tokens + 1)
            probe, _ = await tokenize_with_bos(peers[-1], PROBE, node_id=caps[-1].node_id)
            drafter.check_vocab(probe)
        await rs.open()  # first: the prompt's chunks are the negotiated limits'
        run = _Run(rs, prompt, cfg, spare_caps, lambda: new_completion(cfg, bos, limit), on_token)
        run.drafter = drafter
        run.evidence_dir = ledger.path.parent / "evidence" if ledger.path is not None else None
        result = await run.run()
        if rs.auditor is not None and rs.auditor.passed:
            ledger.passed(sorted(rs.auditor.passed))
        return result
    except asyncio.CancelledError:  # stopped by the user (Ctrl-C) or the caller: nothing will resume it
        await asyncio.shield(rs.abandon())
        raise
    except BaseException:  # a failure: the hops keep the KV detached for their grace period (a resume)
        await rs.close()
        raise
    finally:
        if run is not None:
            await asyncio.shield(run.close())
            await run.reported()
        if drafter is not None:
            drafter.close()


async def _prompt(tail: str, cfg: GenerateConfig, tail_id: str) -> tuple[list[int], int, GenerateConfig]:
    """The prompt's tokens and the vocabulary's BOS id, from the tail; for a chat, ``cfg`` gains the
    chat format's stop strings (as ``create_chat_completion`` adds them to the caller's)."""
    if cfg.messages:
        prompt, bos, stops = await tokenize_chat(tail, list(cfg.messages), node_id=tail_id)
        cfg = replace(cfg, stop=cfg.stop + tuple(s for s in stops if s and s not in cfg.stop))
    else:
        prompt, bos = await tokenize_with_bos(tail, cfg.prompt, node_id=tail_id)
    if not prompt:
        raise errors.InputError("the prompt tokenizes to nothing")
    return prompt, bos, cfg


#: ``on_token(token, released text bytes)``; token None: the end, flushing text held back for a stop string
OnToken = Callable[[int | None, bytes], None]


#: tokens the head decodes on its own while drafting rests (drafts kept failing), before a draft is tried again
REST_BLOCK = 16
#: the drafters ``--draft`` takes ("": none)
DRAFTERS = ("", "ngram", "model")
#: the most tokens one step may draft
MAX_DRAFT = 64


def check_generate(cfg: GenerateConfig) -> None:
    """What ``generate`` (route or local) refuses before any work (InputError)."""
    if cfg.max_tokens < 0:
        raise errors.InputError("max_tokens must be at least 1 (0: as many as the context leaves)")
    check_sampling(cfg.sampling)
    check_stops(cfg.stop)
    if cfg.draft not in DRAFTERS:
        raise errors.InputError(f"--draft must be one of {', '.join(d or 'none' for d in DRAFTERS)}, not {cfg.draft!r}")
    if not 1 <= cfg.draft_max <= MAX_DRAFT:
        raise errors.InputError(f"--draft-max must be from 1 to {MAX_DRAFT}, not {cfg.draft_max}")
    if (cfg.draft == "model") != bool(cfg.model_draft):
        raise errors.InputError("a draft model (--model-draft PATH) goes with drafting by model, and only with it")
    if cfg.model_draft:
        check_file(Path(cfg.model_draft))


def new_completion(cfg: GenerateConfig, bos: int, limit: int) -> Completion:
    """The text tracker of one generation (``limit``: tokens the session's context leaves)."""
    return Completion(max_tokens=cfg.max_tokens, stops=tuple(s.encode("utf-8") for s in cfg.stop), bos=bos,
                      limit=max(limit, 1))


def seed_of(cfg: GenerateConfig) -> int | None:
    return cfg.sampling.seed if cfg.sampling.temperature > 0 else None


async def _spare_capabilities(spares: Sequence[str], head: pb.Capability) -> dict[str, pb.Capability]:
    """Capabilities of the spares that are up, attested and run the route's model and numerics."""
    async def one(endpoint: str) -> tuple[str, pb.Capability | None]:
        try:
            cap = await get_capability(endpoint, 5.0)
            check_attested(endpoint, cap, int(time.time()))
        except errors.MeshnodeError as e:
            log.warning("spare %s is not usable: %s", endpoint, e)
            return endpoint, None
        same = (cap.model_fingerprint == head.model_fingerprint
                and codec.numerics_key(cap.numerics) == codec.numerics_key(head.numerics))
        return endpoint, cap if same else None

    found = await asyncio.gather(*(one(s) for s in spares))
    return {e: c for e, c in found if c is not None}


class _Run:
    """One generation: prefill, decode, and a failover whenever a hop dies and a spare can take over."""

    def __init__(self, rs: RouteSession, prompt: list[int], cfg: GenerateConfig,
                 spares: dict[str, pb.Capability], renew: Callable[[], Completion], on_token: OnToken | None) -> None:
        self.rs, self.prompt, self.cfg, self.on_token = rs, prompt, cfg, on_token
        self.renew = renew
        self.completion = renew()
        #: (token, piece, end of generation) of every result taken, in order (a roll-back replays them)
        self.results: list[tuple[int, bytes, bool]] = []
        #: with an audit: (token, text released, end of generation) not yet passed to on_token (unchecked)
        self.held: list[tuple[int, bytes, bool]] = []
        #: results passed on (or skipped, end of generation) to on_token
        self.emitted = 0
        #: hops caught lying: never taken again in this generation
        self.banned: set[str] = set()
        #: reports of caught lies to trackers, still on their way
        self.reports: list[asyncio.Task[None]] = []
        #: pieces of evidence already kept and reported
        self.n_reported = 0
        #: where caught lies' evidence is kept (None: only reported)
        self.evidence_dir: Path | None = None
        #: the audit check running beside the generation
        self.checking: asyncio.Task[None] | None = None
        #: every peer of the model seen so far, on the route or not (the spares are derived from it)
        self.known: dict[str, pb.Capability] = {**spares, **dict(zip(rs.peers, rs.caps, strict=True))}
        chunk = rs.limits.max_prefill_chunk_tokens or len(prompt)
        self.chunks = [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]
        self.logits: list[np.ndarray] = []
        self.bytes_in: dict[str, int] = {}
        #: decode steps' per-hop timings (session/profile.py), and tokens taken since the last timed one
        self.clock = RouteClock()
        self._untimed = 0
        self.failovers: list[Failover] = []
        self.backoff = Backoff()
        if rs.auditor is not None:
            rs.auditor.watch(rs.peers, rs.caps, self.known)
        #: speculative decoding's draft length (None: not drafting). A session whose hops a replica re-runs
        #: does not draft (the replica re-runs the steps as they were sealed); one with no replica known
        #: drafts and stays unaudited (rs.auditor dropped: a replica found at a failover is not taken up)
        audited = rs.auditor is not None and bool(rs.auditor.shadows)
        drafts = cfg.draft and not audited and can_draft(c.arch for c in rs.caps)
        self.drafting = DraftLength(most=cfg.draft_max) if drafts else None
        if self.drafting is not None:
            rs.auditor = None
        self.draft_stats = {"steps": 0, "drafted": 0, "accepted": 0} if self.drafting else {}
        #: with ``--model-draft``: the draft model (else drafts are prompt lookups)
        self.drafter: ModelDrafter | None = None

    async def run(self) -> GenerationResult:
        rs, cfg = self.rs, self.cfg
        t0 = time.perf_counter()
        prefill = 0.0
        while True:
            try:
                done = False
                if len(rs.history) < len(self.chunks):
                    result = await rs.prefill(self.chunks[len(rs.history):], window=None if self._pipeline() else 1)
                    prefill = time.perf_counter() - t0
                    done = self._take(result)
                t1 = time.perf_counter() if not prefill else t0 + prefill
                while not done:
                    done = await self._decode()
                await self._verify(final=True)
                break
            except errors.MisbehavedError as e:
                if e.hop not in rs.peers or len(self.failovers) >= MAX_FAILOVERS:
                    raise
                await self._stop_checking()
                await self._caught(e)
            except errors.MeshnodeError as e:
                if not can_fail_over(e, rs.peers) or len(self.failovers) >= MAX_FAILOVERS:
                    raise
                await self._stop_checking()
                await self._fail_over(e)
                if rs.auditor is not None:  # the new hop is audited too, from position 0 (not by one that failed)
                    rs.auditor.watch(rs.peers, rs.caps, self.known, self._avoid())
        decode = time.perf_counter() - t1
        await rs.release()
        if self.on_token is not None and (rest := self.completion.release()):
            self.on_token(None, rest)
        c = self.completion
        steps = max(len(rs.sampled) - 1, 1)
        assert c.finish is not None
        return GenerationResult(
            tokens=list(c.tokens), text=c.text, prompt_tokens=self.prompt, stop_reason=c.finish,
            prefill_seconds=prefill, decode_seconds=decode, route=list(rs.peers), logits=self.logits,
            bytes_per_token={k: v / steps for k, v in self.bytes_in.items()},
            failovers=[{k: v for k, v in asdict(f).items() if k != "detected_at"} for f in self.failovers],
            seed=seed_of(cfg), audit=self._audit_summary(), draft=dict(self.draft_stats),
            hops=self.clock.table(decode),
            route_hops=[{"endpoint": p, "node_id": c.node_id, "layers": [c.range.start, c.range.end]}
                        for p, c in zip(rs.peers, rs.caps, strict=True)],
        )

    def _pipeline(self) -> bool:
        """Several prompt chunks in flight: asked for, and hops computing at once would not run more
        threads than their machine's cores (routing/overlap.py)."""
        hw = [c.hardware for c in self.rs.caps]
        return self.cfg.pipeline and not overcommitted([(h.host_id, h.cpus, h.batch_threads) for h in hw])

    async def _decode(self) -> bool:
        """Decode until done or the stream of results ends; True when the generation is over."""
        rs, c = self.rs, self.completion
        # at least one more: Llama lets a text that ends mid-character run past max_tokens
        left = max(min(self.cfg.max_tokens, c.limit) - len(rs.sampled), 1)
        if self.drafting is not None:
            return await self._draft_round(left)
        if not self.cfg.delegate:
            done = self._take(await rs.step([rs.sampled[-1]], sample=True))
            await self._verify()
            return done
        return await self._delegated(left)

    async def _delegated(self, n: int) -> bool:
        """Up to ``n`` tokens decoded by the head's own loop (a Generate); True when the generation is over."""
        results = self.rs.generate(self.rs.sampled[-1], n)
        try:
            async for result in results:
                if self._take(result):
                    return True
                await self._verify()
        finally:
            with contextlib.suppress(Exception):
                await results.aclose()  # type: ignore[attr-defined]
        return False

    async def _draft_round(self, left: int) -> bool:
        """One step with a draft of the text's continuation (or a plain step when there is none); True
        when the generation is over. Each sample is taken as its own result, so the text, its stops and
        its limits are exactly those of decoding one token at a time."""
        rs = self.rs
        assert self.drafting is not None
        wanted = self.drafting.next()
        if wanted == 0 and self.cfg.delegate:  # drafts keep failing: a stretch at the head's own pace
            done = await self._delegated(min(REST_BLOCK, left))
            self.drafting.wake()
            return done
        k = min(wanted, left - 1)
        history = [*self.prompt, *rs.sampled]
        if k <= 0:
            draft: list[int] = []
        elif self.drafter is not None:
            draft = await asyncio.to_thread(self.drafter.propose, history, k)
        else:
            draft = propose(history, k)
        if not draft:
            self.drafting.update(0, 0)  # nothing to draft counts as a draft that failed
            done = self._take(await rs.step([rs.sampled[-1]], sample=True))
            await self._verify()
            return done
        result = await rs.draft_step([rs.sampled[-1], *draft])
        n = len(result.tokens)
        self.drafting.update(len(draft), n - 1)
        for key, add in (("steps", 1), ("drafted", len(draft)), ("accepted", n - 1)):
            self.draft_stats[key] += add
        rows = decode_bundle(result.logits, n_cols=result.logits.shape[1]) if self.cfg.return_logits else None
        for j, tok in enumerate(result.tokens):
            one = pb.StepResult(step_id=result.step_id, token=tok, piece=result.pieces[j],
                                end_of_generation=j == n - 1 and result.end_of_generation)
            if j == n - 1:
                one.timings.extend(result.timings)
            if rows is not None:
                one.logits.CopyFrom(encode_bundle(rows[j : j + 1], max_chunk_bytes=1 << 30))
            if self._take(one):
                return True
        await self._verify()
        return False

    def _take(self, result: pb.StepResult) -> bool:
        """Record one generated token; True when the generation is over."""
        now = time.perf_counter()
        for f in self.failovers:
            if f.seconds_to_next_token is None:
                f.seconds_to_next_token = now - f.detected_at
        if self.cfg.return_logits and not result.end_of_generation:  # one row per returned token
            self.logits.append(decode_bundle(result.logits, n_cols=result.logits.shape[1]
                                             if result.logits.shape else 0)[0])
        self.rs.sampled.append(result.token)
        if len(self.rs.sampled) > 1:  # a decoded token (the first one came from the prompt)
            for t in result.timings:
                self.bytes_in[t.endpoint] = self.bytes_in.get(t.endpoint, 0) + t.bytes_in
            self._untimed += 1  # a draft step's timings come with its last token
            if result.timings:
                self.clock.add([(t.endpoint, t.compute_nanos, t.handle_nanos) for t in result.timings],
                               self._untimed)
                self._untimed = 0
        self.results.append((result.token, result.piece, result.end_of_generation))
        done = self.completion.add(result.token, result.piece, eog=result.end_of_generation)
        self.held.append((result.token, self.completion.release(), result.end_of_generation))
        a = self.rs.auditor
        self._pass_on(len(self.results) if a is None or not a.shadows else self._checked_results())
        return done

    # -- audits (docs/security.md, "A hop that lies") ------------------------------------

    def _checked_results(self) -> int:
        """Results whose every step was checked: the token sampled from the chunk ending at position
        p is the (p - prompt length)th, so a check through position c covers c - prompt + 1 of them."""
        assert self.rs.auditor is not None
        return max(self.rs.auditor.checked - len(self.prompt) + 1, 0)

    def _pass_on(self, upto: int) -> None:
        """Hand held results up to the ``upto``th to ``on_token`` (a stream holds unchecked text back)."""
        while self.held and self.emitted < upto:
            token, text, eog = self.held.pop(0)
            self.emitted += 1
            if self.on_token is not None and not eog:
                self.on_token(token, text)

    async def _verify(self, *, final: bool = False) -> None:
        """Start a check when one is due (every ``audit.every`` steps): it runs beside the generation
        (the replicas compute while the route does), and is waited for once it is done, when the
        generation is two checks ahead of it, and at the end, where a last check covers every step."""
        rs, a = self.rs, self.rs.auditor
        if a is None:
            return
        if self.checking is not None and (final or self.checking.done() or rs.n_past - a.checked >= 2 * a.every):
            task, self.checking = self.checking, None
            await task  # MisbehavedError: a lie, caught
        if self.checking is None and (final or a.due(rs.n_past)):
            check = a.check(list(rs.peers), list(rs.caps), [list(c) for c in rs.history], rs.id, len(self.prompt))
            if final:
                await check
            else:
                self.checking = asyncio.ensure_future(check)
        self._pass_on(len(self.results) if final or not a.shadows else self._checked_results())

    async def _stop_checking(self) -> None:
        """The route changes under a check in flight: stop it; its shadows start over (a shadow stopped
        mid-step cannot go on), watching the new route."""
        a = self.rs.auditor
        if self.checking is not None:
            task, self.checking = self.checking, None
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if a is not None:
            await a.close()

    async def _caught(self, e: errors.MisbehavedError) -> None:
        """A hop lied: keep the evidence, go back to the lie, fail over away from the liar for good."""
        rs, a = self.rs, self.rs.auditor
        assert a is not None
        assert e.hop is not None
        log.error("hop %s lied (%s): rolling back to position %d and re-routing", e.hop, e.message, e.pos)
        self.banned.add(e.hop)
        if a.caught and a.caught[-1]["hop"] == e.hop:
            a.caught[-1]["route_at_position"] = rs.n_past  # how far the generation had gone meanwhile
        for what, env in a.evidence[self.n_reported:]:
            self._report(env, what)
        self.n_reported = len(a.evidence)
        self._roll_back(e.pos)
        await a.roll_back(rs.n_past)
        await self._fail_over(e)
        a.watch(rs.peers, rs.caps, self.known, self._avoid())

    async def close(self) -> None:
        """Stop a check still running (the generation failed or was stopped)."""
        await self._stop_checking()

    def _roll_back(self, pos: int) -> None:
        """Forget every position from the chunk at ``pos`` on and the tokens sampled from them; the
        text is rebuilt from the results kept (what was passed on already is the same text)."""
        rs = self.rs
        keep, q = [], 0
        for chunk in rs.history:
            if q + len(chunk) > pos:
                break
            keep.append(chunk)
            q += len(chunk)
        rs.history, rs.n_past = keep, q
        kept = q - len(self.prompt) + 1 if q >= len(self.prompt) else 0
        del rs.sampled[kept:], self.results[kept:], self.logits[kept:]
        self.completion, self.held = self.renew(), []
        for j, (token, piece, eog) in enumerate(self.results):
            self.completion.add(token, piece, eog=eog)
            text = self.completion.release()
            if j >= self.emitted:
                self.held.append((token, text, eog))
        self.emitted = min(self.emitted, kept)

    def _report(self, env: pb.SignedEnvelope, what: dict[str, object]) -> None:
        """Keep the evidence in the state dir (its path goes into ``what``) and send it to the
        trackers (in the background)."""
        where = self.evidence_dir
        path = where / f"{int(time.time())}-{str(what['node_id'])[:16]}.pb" if where is not None else None
        try:
            if where is None or path is None:
                raise OSError("this initiator keeps no state")
            where.mkdir(parents=True, exist_ok=True)
            write_evidence(path, env)
            what["evidence"] = str(path)
            log.error("evidence of the lie kept in %s (check it: meshnode verify-evidence %s --model GGUF)", path,
                      path)
        except (OSError, errors.MeshnodeError) as e:
            log.warning("could not keep the evidence in %s: %s", path, e)
        for url in self.cfg.report_to:
            self.reports.append(asyncio.ensure_future(_report_to(url, env)))

    async def reported(self) -> None:
        """Wait (bounded) for the reports of caught lies to reach their trackers."""
        if self.reports:
            await asyncio.wait(self.reports, timeout=REPORT_TIMEOUT)

    def _audit_summary(self) -> dict[str, object]:
        a = self.rs.auditor
        if a is None:
            return {"audited": False}
        return {"audited": True, "every": self.cfg.audit.every, "hops": dict(a.audited),
                "checked_positions": a.checked, "caught": list(a.caught)}

    def _avoid(self) -> frozenset[str]:
        """Hops a route or an audit does not use now: liars, and hops that failed lately (backing off)."""
        return self.backoff.avoided(time.monotonic()) | frozenset(self.banned)

    async def _fail_over(self, e: errors.MeshnodeError) -> None:
        rs = self.rs
        t0 = time.perf_counter()
        assert e.hop is not None
        idx = rs.peers.index(e.hop)
        dead = rs.caps[idx]
        span = (dead.range.start, dead.range.end)
        if e.code == "CACHE_MISS":
            # the hop is up but lacks state (it restarted): same route, replay rebuilds it
            log.warning("hop %s (layers %d:%d) lost the session's KV state; replaying", e.hop, *span)
            new, new_caps = [e.hop], [dead]
        else:
            self.backoff.fail(e.hop, time.monotonic())
            log.warning("hop %s (layers %d:%d) failed: %s; re-routing that span", e.hop, *span, e)
            known = [Candidate(c.node_id, ep, c.range.start, c.range.end, c.throughput.decode_tokens_per_second,
                               0.0, 1) for ep, c in self.known.items()]
            try:
                chain = replacement(span, spare_candidates(known, rs.peers), self._avoid())
                new = [c.endpoint for c in chain]
                new_caps = [self.known[p] for p in new]
            except errors.RouteError as why:
                if isinstance(e, errors.MisbehavedError):  # a liar is not waited for
                    raise errors.MisbehavedError(f"{e.message}; {why.message}", hop=e.hop, pos=e.pos) from e
                back = await self._comeback(e.hop, dead)
                if back is None:
                    raise type(e)(f"{e.message}; {why.message}, and it did not come back within "
                                  f"{self.cfg.rejoin_wait:g}s", hop=e.hop) from e
                new, new_caps = [e.hop], [back]
        peers = [*rs.peers[:idx], *new, *rs.peers[idx + 1 :]]
        caps = [*rs.caps[:idx], *new_caps, *rs.caps[idx + 1 :]]
        check_chain([peer_view(p, c) for p, c in zip(peers, caps, strict=True)])
        self.known.update(zip(new, new_caps, strict=True))  # a hop that came back may serve anew
        f = Failover(hop=e.hop, layers=f"{span[0]}:{span[1]}", error=str(e), replacement=new, replayed_positions=0,
                     recovery_seconds=0.0, detected_at=t0)
        self.failovers.append(f)
        f.replayed_positions = await rs.resume(peers, caps)
        f.recovery_seconds = time.perf_counter() - t0
        log.warning("re-routed layers %d:%d to %s in %.3fs (%d positions replayed)", *span, ", ".join(new),
                    f.recovery_seconds, f.replayed_positions)

    async def _comeback(self, endpoint: str, was: pb.Capability) -> pb.Capability | None:
        """Wait up to ``rejoin_wait`` for a failed hop to serve its range again (e.g. restarted by systemd)."""
        deadline = time.monotonic() + self.cfg.rejoin_wait
        pause = 0.25
        while time.monotonic() < deadline:
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 2.0)
            try:
                cap = await get_capability(endpoint, max(min(2.0, deadline - time.monotonic()), 0.1),
                                           node_id=was.node_id)  # the same node back, not whoever took its port
                check_attested(endpoint, cap, int(time.time()))
            except errors.MeshnodeError:
                continue
            if (cap.model_fingerprint, cap.range.start, cap.range.end) == (
                    was.model_fingerprint, was.range.start, was.range.end) and codec.numerics_key(
                    cap.numerics) == codec.numerics_key(was.numerics):
                self.backoff.succeed(endpoint)
                return cap
        return None
