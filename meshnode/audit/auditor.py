"""The initiator's spot checks of a route's hops (docs/security.md, "A hop that lies").

An audited hop is re-run by a *replica*: another node serving exactly its layers with the same
numerics, so its results are bit-identical by construction (failover relies on the same). The
replica runs an audit session (``RouteOpen.audit``) that the initiator feeds itself, chunk by
chunk in the original chunking: the head's token ids, or the residual rows the hop before the
audited one sent it — fetched from that hop's replay store (``Outputs``) and checked against both
hops' seals, so neither can disown them. Every ``every`` steps, and once more before a result is
returned, each new chunk's output digest sealed by the audited hop must equal the replica's. The
replica rebuilds the hop's KV from position 0, so a check at step k covers every step up to k: a
lie is caught at the first check after it.

A disagreement raises ``MisbehavedError`` at the first wrong chunk (the initiator rolls back to
it and fails over away from the hop) and leaves signed ``Evidence``: the hop's seals and inputs
from position 0 through the wrong chunk, which anyone with the model can recompute.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from meshnode import errors
from meshnode.audit.evidence import sign_evidence
from meshnode.audit.seals import open_seal, rows_digest, tokens_digest
from meshnode.identity import NodeIdentity
from meshnode.identity.routeauth import HopPlan, sign_control, sign_route
from meshnode.proto import node_pb2 as pb
from meshnode.transport.client import outputs
from meshnode.transport.stream import FrameStream
from meshnode.wire import codec
from meshnode.wire.schema import SCHEMA_VERSION
from meshnode.wire.tensors import decode_bundle, encode_bundle

log = logging.getLogger("meshnode.audit")

#: the largest residual a fetched chunk may carry (bytes): the Outputs message bound
MAX_FETCH_BYTES = 64 << 20

Given = list[int] | pb.TensorBundle


@dataclass
class Shadow:
    """A replica re-running one audited hop in an audit session; positions [0, checked) verified."""

    audited: str  # the audited hop's node id
    endpoint: str  # the replica
    cap: pb.Capability
    session_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    stream: FrameStream | None = None
    step_id: int = 0
    checked: int = 0
    #: what the audited hop was given per chunk, by position (the evidence, should it lie)
    inputs: dict[int, Given] = field(default_factory=dict)

    async def open(self, ident: NodeIdentity, wire_dtype: int, timeout: float,
                   sampling: pb.Sampling | None = None) -> None:
        cap = self.cap
        plan = HopPlan(cap.node_id, cap.attestation.signer_public_key, cap.range.start, cap.range.end)
        (signed,) = sign_route(ident, session_id=self.session_id, epoch=1, fingerprint=cap.model_fingerprint,
                               hops=[plan], now=int(time.time()), audit=True)
        o = pb.SessionOpen(schema_version=SCHEMA_VERSION, route_session_id=self.session_id, route_epoch=1,
                           model_fingerprint=cap.model_fingerprint, range=cap.range, signed_open=signed,
                           limits=cap.limits, wire_dtype=wire_dtype,  # type: ignore[arg-type]
                           numerics=cap.numerics, deadline_unix_nanos=codec.deadline_in(timeout), sampling=sampling)
        self.stream = FrameStream(self.endpoint, cap.node_id)
        reply = await self.stream.exchange(pb.SessionFrame(route_session_id=self.session_id, route_epoch=1,
                                                           open=o), timeout)
        if reply.HasField("error"):
            raise codec.error_from_pb(reply.error)
        if not reply.HasField("accepted"):
            raise errors.PeerError("answered an audit open with something else", hop=self.endpoint)

    async def run(self, pos: int, given: Given, timeout: float, *, sample: bool = False) -> pb.StepSeal:
        """The replica's seal of one chunk (with ``sample``, a tail's seal names the token it drew)."""
        assert self.stream is not None
        self.step_id += 1
        step = pb.Step(step_id=self.step_id, cache=pb.CacheExpectation(n_past=pos), sample=sample,
                       deadline_unix_nanos=codec.deadline_in(timeout))
        if isinstance(given, list):
            step.tokens.extend(given)
        else:
            step.activation.CopyFrom(given)
        reply = await self.stream.exchange(pb.SessionFrame(route_session_id=self.session_id, route_epoch=1,
                                                           step=step), timeout)
        if reply.HasField("error"):
            raise codec.error_from_pb(reply.error)
        if not reply.HasField("result") or not reply.result.timings:
            raise errors.PeerError("answered an audit step with something else", hop=self.endpoint)
        s = open_seal(reply.result.timings[0].seal, self.cap.node_id)
        if s.pos_start != pos:
            raise errors.PeerError(f"sealed position {s.pos_start} for a chunk at {pos}", hop=self.endpoint)
        return s

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.close()  # the replica frees the audit session when its stream ends


class Auditor:
    """Seals of a route session's steps, and the shadows checking its audited hops."""

    def __init__(self, ident: NodeIdentity, *, every: int, wire_dtype: int, step_timeout: float,
                 sampling: pb.Sampling | None = None) -> None:
        self.ident, self.every, self.wire_dtype, self.timeout = ident, every, wire_dtype, step_timeout
        #: the session's sampling: an audited tail's replica draws with the same chain
        self.sampling = sampling
        self.rng = random.Random()
        #: the latest seal of each hop (node id) for each chunk (first position)
        self.seals: dict[str, dict[int, pb.SignedEnvelope]] = {}
        #: audited hop's node id -> its shadow
        self.shadows: dict[str, Shadow] = {}
        #: node ids whose every step was checked up to ``checked``
        self.passed: set[str] = set()
        #: positions [0, checked) of the route verified by every shadow
        self.checked = 0
        #: each lie caught that a verifier can recompute, with its signed Evidence
        self.evidence: list[tuple[dict[str, object], pb.SignedEnvelope]] = []
        #: what was caught, for the result: hop, layers, position, replica
        self.caught: list[dict[str, object]] = []
        #: hops (endpoint -> replica endpoint) audited at some point
        self.audited: dict[str, str] = {}

    # -- which hops --------------------------------------------------------------------

    def watch(self, peers: Sequence[str], caps: Sequence[pb.Capability], known: Mapping[str, pb.Capability],
              avoid: frozenset[str] = frozenset()) -> None:
        """Shadow every hop of the route that has a replica among ``known`` (not on the route, not
        in ``avoid``); a hop with none goes unaudited (logged)."""
        on_route = set(peers)
        for ep, cap in zip(peers, caps, strict=True):
            if cap.node_id in self.shadows:
                continue
            replicas = sorted(e for e, c in known.items() if e not in on_route and e not in avoid
                              and c.node_id != cap.node_id and same_range(c, cap))
            if not replicas:
                log.info("no replica of layers %d:%d is known: hop %s is not audited", cap.range.start,
                         cap.range.end, ep)
                continue
            pick = self.rng.choice(replicas)  # not the lowest address: a node could place itself there
            self.shadows[cap.node_id] = Shadow(cap.node_id, pick, known[pick])
            self.audited[ep] = pick

    def record(self, result: pb.StepResult) -> None:
        """Keep the seals a step's result carries (verified when a check uses them)."""
        for t in result.timings:
            if t.seal.payload:
                try:
                    s = pb.StepSeal.FromString(t.seal.payload)
                except DecodeError:
                    continue  # unusable: a check that needs it finds none
                self.seals.setdefault(s.hop_node_id, {})[s.pos_start] = t.seal

    def due(self, n_past: int) -> bool:
        return bool(self.shadows) and n_past - self.checked >= self.every

    # -- checks ------------------------------------------------------------------------

    async def check(self, peers: Sequence[str], caps: Sequence[pb.Capability], history: Sequence[Sequence[int]],
                    session_id: str, n_prompt: int) -> None:
        """Check every shadowed hop's chunks since its last check (a chunk reaching past the prompt's
        ``n_prompt`` positions was sampled from). ``MisbehavedError`` at the first wrong one; a replica
        or a fetch that fails leaves that hop unaudited (logged)."""
        chunks, pos = [], 0
        for c in history:
            chunks.append((pos, list(c)))
            pos += len(c)
        ids = [c.node_id for c in caps]
        for node_id, sh in list(self.shadows.items()):
            if node_id not in ids:  # failed over away from: nothing more to check
                await self._drop(node_id)
                continue
            i = ids.index(node_id)
            try:
                await self._check_hop(peers, caps, i, sh, [c for c in chunks if c[0] >= sh.checked], session_id,
                                      n_prompt)
            except errors.MisbehavedError:
                raise
            except errors.MeshnodeError as e:
                log.warning("audit of hop %s by replica %s stopped: %s", peers[i], sh.endpoint, e)
                await self._drop(node_id)
                continue
            self.passed.add(node_id)
        self.checked = pos

    async def _check_hop(self, peers: Sequence[str], caps: Sequence[pb.Capability], i: int, sh: Shadow,
                         todo: list[tuple[int, list[int]]], session_id: str, n_prompt: int) -> None:
        if not todo:
            return
        ep, cap = peers[i], caps[i]
        tail = i == len(caps) - 1
        if sh.stream is None:
            await sh.open(self.ident, self.wire_dtype, self.timeout, self.sampling if tail else None)
        fetched: dict[int, pb.TensorBundle] = {}
        if i > 0:
            fetched = await self._fetch(peers[i - 1], caps[i - 1].node_id, session_id, todo[0][0],
                                        todo[-1][0] + len(todo[-1][1]))
        for pos, toks in todo:
            mine = self._open(cap.node_id, pos, ep)
            if (mine.pos_start, mine.n_tokens) != (pos, len(toks)):
                raise errors.MisbehavedError(f"sealed positions {mine.pos_start}+{mine.n_tokens} for the chunk "
                                             f"{pos}+{len(toks)}", hop=ep, pos=pos)
            given: Given
            if i == 0:
                if mine.input_sha256 != tokens_digest(toks):
                    raise errors.MisbehavedError(f"sealed other token ids than it was sent at position {pos}",
                                                 hop=ep, pos=pos)
                given = toks
            else:
                given = self._input(peers[i - 1], caps[i - 1], mine, fetched.get(pos), pos, len(toks), cap, sh)
            sh.inputs[pos] = given
            theirs = await sh.run(pos, given, self.timeout, sample=tail and pos + len(toks) >= n_prompt)
            expected = theirs.output_sha256
            if expected == mine.output_sha256 and mine.HasField("token") and mine.token != theirs.token:
                self.caught.append({"hop": ep, "node_id": cap.node_id, "layers": f"{cap.range.start}:{cap.range.end}",
                                    "position": pos, "step_id": mine.step_id, "replica": sh.endpoint,
                                    "noticed_at_position": todo[-1][0] + len(todo[-1][1]), "drew": mine.token,
                                    "replica_drew": theirs.token})
                raise errors.MisbehavedError(f"drew token {mine.token} at position {pos + len(toks) - 1} where the "
                                             f"same sampler chain draws {theirs.token} from the same logits", hop=ep,
                                             pos=pos)
            if expected != mine.output_sha256:
                self.caught.append({"hop": ep, "node_id": cap.node_id, "layers": f"{cap.range.start}:{cap.range.end}",
                                    "position": pos, "step_id": mine.step_id, "replica": sh.endpoint,
                                    "noticed_at_position": todo[-1][0] + len(todo[-1][1])})
                self.evidence.append((self.caught[-1], self._evidence(cap, i, caps, sh, pos, expected)))
                raise errors.MisbehavedError(
                    f"layers {cap.range.start}:{cap.range.end}: its output for positions {pos}..{pos + len(toks) - 1} "
                    f"differs from replica {sh.endpoint}'s recomputation of the same input", hop=ep, pos=pos)
            sh.checked = pos + len(toks)

    def _input(self, prev_ep: str, prev: pb.Capability, mine: pb.StepSeal, bundle: pb.TensorBundle | None,
               pos: int, n: int, cap: pb.Capability, sh: Shadow) -> pb.TensorBundle:
        """The residual the audited hop was given for one chunk, held to both hops' seals."""
        if bundle is None:
            raise errors.PeerError(f"holds no output for the chunk at position {pos}", hop=prev_ep)
        rows = decode_bundle(bundle, n_cols=cap.n_embd, n_rows=n, max_chunk_bytes=MAX_FETCH_BYTES)
        digest = rows_digest(rows, self.wire_dtype)
        sent = self._open(prev.node_id, pos, prev_ep)
        if sent.output_sha256 != digest:
            raise errors.MisbehavedError(f"its stored output for position {pos} is not what it sealed it sent",
                                         hop=prev_ep, pos=pos)
        if mine.input_sha256 != digest:
            raise errors.MisbehavedError(f"sealed another input at position {pos} than {prev_ep} sealed it sent",
                                         hop=prev_ep, pos=pos)
        return encode_bundle(rows, dtype=self.wire_dtype, pos_start=pos,
                             max_chunk_bytes=sh.cap.limits.max_chunk_bytes or 1 << 20)

    def _open(self, node_id: str, pos: int, ep: str) -> pb.StepSeal:
        env = self.seals.get(node_id, {}).get(pos)
        if env is None:
            raise errors.PeerError(f"no seal for the chunk at position {pos} (a node without seals?)", hop=ep)
        try:
            return open_seal(env, node_id)
        except errors.SignatureError as e:
            raise errors.MisbehavedError(f"its seal for position {pos} does not verify: {e.message}", hop=ep,
                                         pos=pos) from e

    async def _fetch(self, ep: str, node_id: str, session_id: str, start: int, end: int) -> dict[int, pb.TensorBundle]:
        """The previous hop's stored outputs for positions [start, end), asked for again where a
        size-bounded reply stopped."""
        got: dict[int, pb.TensorBundle] = {}
        while start < end:
            auth = sign_control(self.ident, session_id, "outputs", now=int(time.time()))
            chunks = await outputs(ep, node_id, session_id, auth, start, end, self.timeout)
            if not chunks:
                break
            for b in chunks:
                got[b.pos_start] = b
            last = chunks[-1]
            nxt = last.pos_start + (last.shape[0] if last.shape else 0)
            if nxt <= start:
                break
            start = nxt
        return got

    def _evidence(self, cap: pb.Capability, i: int, caps: Sequence[pb.Capability], sh: Shadow, pos: int,
                  expected: bytes) -> pb.SignedEnvelope:
        prev = caps[i - 1].node_id if i else ""
        ev = pb.Evidence(accused_node_id=cap.node_id, model_fingerprint=cap.model_fingerprint, range=cap.range,
                         wrong_pos_start=pos, expected_output_sha256=expected, replica_node_id=sh.cap.node_id,
                         reported_at_unix=int(time.time()))
        for q in sorted(p for p in sh.inputs if p <= pos):
            st = ev.steps.add()
            st.seal.CopyFrom(self.seals[cap.node_id][q])
            given = sh.inputs[q]
            if isinstance(given, list):
                st.tokens.extend(given)
            else:
                st.activation.CopyFrom(given)
                st.sender_seal.CopyFrom(self.seals[prev][q])
        return sign_evidence(self.ident, ev)

    # -- after a lie -------------------------------------------------------------------

    async def roll_back(self, pos: int) -> None:
        """The route goes back to position ``pos``: seals past it are void, and the shadows (whose
        replicas hold KV past it) start over when the route is watched again."""
        for by_pos in self.seals.values():
            for q in [q for q in by_pos if q >= pos]:
                del by_pos[q]
        for node_id in list(self.shadows):
            await self._drop(node_id)
        self.checked = min(self.checked, pos)

    async def _drop(self, node_id: str) -> None:
        sh = self.shadows.pop(node_id, None)
        self.passed.discard(node_id)
        if sh is not None:
            await sh.close()

    async def close(self) -> None:
        for node_id in list(self.shadows):
            sh = self.shadows.pop(node_id)
            await sh.close()


def same_range(a: pb.Capability, b: pb.Capability) -> bool:
    """``a`` can recompute ``b``'s steps bit for bit: same model, layers and numerics."""
    return (a.model_fingerprint == b.model_fingerprint and (a.range.start, a.range.end) == (b.range.start, b.range.end)
            and codec.numerics_key(a.numerics) == codec.numerics_key(b.numerics))
