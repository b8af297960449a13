"""A node's route sessions: the table of them and each one's stream, served frame by frame.

Every frame on a Session stream gets exactly one reply, so the stream stays
in lock step. A session whose stream ends without a release or cancel (its
initiator or a neighbour died) is detached, not freed: its KV state waits
``detach_grace`` seconds for a resume (failover), is evicted first when an
open needs its slot, and is freed by ``sweep()`` after that.

A MeshnodeError becomes an ``Error`` frame carrying its code; anything else is
a bug, logged and answered as INTERNAL (terminal) — the node keeps serving
other sessions. The stream itself is transport's (transport/servicer.py adapts
gRPC's to ``replies.Stream``); what to admit, evict, claim and cut is decided
by session/admission.py's pure functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from meshnode import errors
from meshnode.executor.api import RangeExecutor
from meshnode.http.ratelimit import RateTable
from meshnode.identity import NodeIdentity
from meshnode.identity.routeauth import check_control, parse_open
from meshnode.metrics import NodeMetrics
from meshnode.proto import node_pb2 as pb
from meshnode.session import admission
from meshnode.session.admission import Recent
from meshnode.session.flow import Flow
from meshnode.session.hop import HopLimits, HopSession
from meshnode.session.inuse import is_head, routes_in_use
from meshnode.session.replies import Control, ReplyWriter, Stream
from meshnode.wire import codec

log = logging.getLogger("meshnode.node")

#: seconds between looks for a freed slot while an open waits for one
ADMISSION_POLL = 0.02
#: session ids a node remembers as cancelled before their open (anyone may send such a cancel)
MAX_EARLY_CANCELS = 4096
#: residual bytes one Outputs reply carries at most (under the 64 MiB message bound)
MAX_OUTPUTS_BYTES = 32 << 20


class SessionHost:
    """The route sessions this node hosts: live, detached (kept for a resume) and cancelled early,
    and each one's stream served frame by frame. What to admit, evict, claim and cut is decided by
    session/admission.py's pure functions; this class holds the state they decide on."""

    def __init__(self, executor: RangeExecutor, capability: Callable[[], pb.Capability], limits: HopLimits,
                 endpoint: str, ident: NodeIdentity) -> None:
        self.executor = executor
        self.ident = ident
        self.metrics = NodeMetrics(live_sessions=lambda: executor.live_slots)
        self.nonces: dict[bytes, int] = {}
        #: makes a freshly signed capability; renewed well before its attestation expires
        self._make_capability = capability
        self.capability = capability()
        self.limits = limits
        self.endpoint = endpoint
        self.sessions: dict[str, HopSession] = {}
        #: sessions whose stream broke without a release: KV kept for a resume (failover)
        self.detached: dict[str, HopSession] = {}
        #: ids cancelled before (or without) their open (the last MAX_EARLY_CANCELS)
        self.cancelled = Recent(MAX_EARLY_CANCELS)
        #: for those: who cancelled (an open by anyone else is not refused by it)
        self.early_cancellers: dict[str, str] = {}
        self.serving = True
        #: opens per initiator (session/admission.py ``open_rate``)
        self.opens = RateTable(limits.opens_per_minute / 60.0, limits.opens_burst)

    # -- what the node's unary calls read and do ------------------------------------

    def current_capability(self) -> pb.Capability:
        """The signed capability, renewed once half its attestation's lifetime is gone."""
        att = pb.Attestation.FromString(self.capability.attestation.payload)
        if att.expires_at_unix - time.time() < (att.expires_at_unix - att.issued_at_unix) / 2:
            self.capability = self._make_capability()
        return self.capability

    def health(self) -> pb.HealthReply:
        """Load and headline figures: answered to Health, sent with tracker heartbeats."""
        ex, m = self.executor, self.metrics
        return pb.HealthReply(serving=self.serving, live_sessions=ex.live_slots, free_sessions=ex.free_slots,
                              steps_total=ex.steps_total, tokens_total=m.tokens_total(),
                              errors_total=m.errors_total(), step_seconds_mean=m.step_seconds_mean(),
                              detached_sessions=len(self.detached), batches_total=ex.batches_total,
                              routes=routes_in_use(self._headed()))

    def _headed(self) -> list[tuple[str, ...]]:
        """The routes of the live sessions this node is the head of: itself, then their downstream hops."""
        own = self.ident.node_id
        return [(own, *(h.node_id for h in s.open_msg.downstream)) for s in self.sessions.values()
                if s.open_msg is not None and is_head(s.route_open)]

    def authorize(self, env: pb.SignedEnvelope, sid: str, action: str, work: str) -> None:
        """Only the session's initiator may release or cancel it: the control's own error if it does not
        verify, OpenUnauthenticatedError if someone else signed it (both PERMISSION_DENIED on the wire)."""
        signer = check_control(env, session_id=sid, action=action, work_id=work, now=int(time.time()))
        s = self.sessions.get(sid)
        owner = s.route_open.initiator_node_id if s is not None else self.early_cancellers.get(sid, signer)
        if signer != owner:
            raise errors.OpenUnauthenticatedError(f"only the initiator of session {sid} may {action} it")
        if s is None and action == "cancel":
            self.early_cancellers.setdefault(sid, signer)
            while len(self.early_cancellers) > MAX_EARLY_CANCELS:
                del self.early_cancellers[next(iter(self.early_cancellers))]

    async def release(self, sid: str) -> pb.ReleaseReply:
        """A release by its initiator (``authorize`` first), out of band."""
        s = self.sessions.pop(sid, None) or self.detached.pop(sid, None)
        if s is None:
            return pb.ReleaseReply(released=False)
        s.detachable = False
        await s.close()
        return pb.ReleaseReply(released=True)

    def outputs(self, request: pb.OutputsRequest) -> pb.OutputsReply:
        """The residual rows this hop sent on for a session's chunks: only to its initiator (the order's own
        error if it does not verify; UnknownSessionError for no session of the signer's); bounded to
        ``MAX_OUTPUTS_BYTES`` a reply (the initiator asks again from where it stopped)."""
        sid = request.route_session_id
        s = self.sessions.get(sid) or self.detached.get(sid)
        signer = check_control(request.auth, session_id=sid, action="outputs", work_id="", now=int(time.time()))
        if s is None or s.route_open.initiator_node_id != signer:
            raise errors.UnknownSessionError(f"no session {sid} of yours here")
        reply, size = pb.OutputsReply(), 0
        for bundle in s.outputs(request.pos_start, request.pos_end):
            size += bundle.total_bytes
            if size > MAX_OUTPUTS_BYTES and reply.chunks:
                break
            reply.chunks.append(bundle)
        return reply

    async def cancel(self, sid: str, work: str) -> pb.CancelReply:
        """A cancel by its initiator (``authorize`` first), out of band: of one work item, or of the session."""
        s = self.sessions.get(sid)
        if work:
            if s is None or work in s.cancelled_work:
                return pb.CancelReply(cancelled=False)
            s.cancelled_work.add(work)
            return pb.CancelReply(cancelled=True)
        fresh = sid not in self.cancelled
        self.cancelled.add(sid)
        s = self.sessions.pop(sid, None) or self.detached.pop(sid, None)
        if s is not None:
            s.detachable = False
            await s.close()
        return pb.CancelReply(cancelled=fresh)

    # -- detached sessions (failover) ------------------------------------------------

    async def sweep(self, now: float | None = None) -> int:
        """Free detached sessions older than the grace period; returns how many."""
        now = time.monotonic() if now is None else now
        old = admission.expired(self._detached_at(), now, self.limits.detach_grace)
        for sid in old:
            await self.detached.pop(sid).close()
        return len(old)

    def _detached_at(self) -> dict[str, float]:
        return {sid: d.detached_at for sid, d in self.detached.items()}

    def _admit(self, ro: pb.RouteOpen) -> None:
        """A verified open, before it takes a slot: within its initiator's opens a minute?"""
        admission.open_rate(self.opens, ro.initiator_node_id, time.monotonic(), self.limits.opens_per_minute)

    async def drop_detached(self) -> None:
        """Free every detached session (the node is draining)."""
        while self.detached:
            _, d = self.detached.popitem()
            await d.close()

    async def _claim(self, sid: str, frame: pb.SessionFrame) -> HopSession | None:
        """For a resume: the detached session ``sid``, once its old stream has ended (bounded wait).

        A stream whose upstream vanished without a word (a partition) never ends by itself: if the
        resume is signed by the session's own initiator under a later epoch (it has moved on), the
        old stream is ended here and its session taken over (``admission.supersedes``)."""
        old = self.sessions.get(sid)
        if old is not None:
            # the initiator tore the old route down; this hop may not have noticed yet
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(old.ended.wait(), self.limits.step_timeout / 10)
            if self.sessions.get(sid) is old:
                ro = parse_open(frame.open.signed_open)  # its signature checked: OpenForgedError if not
                task = old.task
                if not admission.supersedes(old.route_open.initiator_node_id, old.epoch, ro.initiator_node_id,
                                            frame.route_epoch) or task is None:
                    raise errors.SessionError(f"session {sid} is still live on this hop (a resume may "
                                              f"supersede it only from its own initiator under a later epoch)")
                log.info("session %s: a resume under epoch %d supersedes its stream at epoch %d (its upstream "
                         "went silent)", sid, frame.route_epoch, old.epoch)
                task.cancel()  # the handler's clean-up detaches the session (shielded)
                # its clean-up may first wait out a step in flight (the kernels cannot be interrupted):
                # bounded by a step's time, not a fraction of it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(old.ended.wait(), self.limits.step_timeout)
                if self.sessions.get(sid) is old:
                    raise errors.SessionError(f"session {sid} is still live on this hop: its stream at epoch "
                                              f"{old.epoch} did not end within {self.limits.step_timeout:g}s")
        return self.detached.pop(sid, None)

    async def _make_room(self) -> None:
        """No free slot: evict the oldest detached session rather than refuse a live open; with none
        detached, wait (up to ``admission_wait``) for a session that is ending to free its slot:
        a stream whose peer just hung up frees it a moment later. Then the open may still be
        refused (RESOURCE_EXHAUSTED), never queued for long."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.admission_wait
        while self.executor.free_slots == 0:
            sid = admission.room(self._detached_at())
            if sid is not None:
                await self.detached.pop(sid).close()
            elif loop.time() >= deadline:
                return
            else:
                await asyncio.sleep(ADMISSION_POLL)

    async def _end(self, session: HopSession) -> None:
        """A stream is over: detach its session (if it may resume) or free it."""
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        if session.detachable and session.slot is not None and self.serving:
            # listed as detached before anything is awaited: a Release or resume arriving meanwhile
            # must find it (else it would sit out the whole grace period, found by neither)
            session.detached_at = time.monotonic()
            stale = [self.detached.pop(session.session_id, None)]
            bound = self.limits.max_detached or self.executor.config.max_sessions
            stale += [self.detached.pop(sid) for sid in admission.over_detached(self._detached_at(), bound)]
            self.detached[session.session_id] = session
            for old in stale:
                if old is not None:
                    await old.close()
            await session.detach()
        else:  # a broken stream on a draining node: the hops after it may still serve a resume
            await session.close(end_downstream=not session.detachable)
        session.ended.set()

    # -- the session stream ---------------------------------------------------------

    async def serve(self, stream: Stream) -> None:
        """One route session: this coroutine executes frames in order; a reader task reads ahead.

        Reading ahead is what makes credits enforceable (a step beyond them is
        refused on arrival, not queued) and lets cancel, release and credit
        grants act while a step or a Generate is running.
        """
        session = HopSession(self.executor, self.capability, self.limits, self.endpoint, self.ident, self.nonces,
                             admit=self._admit, task=asyncio.current_task())
        writer = ReplyWriter(stream, self.metrics)
        reader: asyncio.Task[None] | None = None
        try:
            try:
                first = await stream.read()
            except errors.WireError as e:
                await writer.write(pb.SessionReply(error=codec.error_to_pb(e, hop=self.endpoint, terminal=True)))
                return
            if first is None:
                return
            if not await self._open(session, first, writer):
                return
            ctl = Control(Flow(session.negotiated.credits))
            reader = asyncio.ensure_future(self._read_ahead(stream, session, ctl.queue, writer, ctl))
            while (frame := await ctl.queue.get()) is not None and not ctl.over:
                if isinstance(frame, errors.MeshnodeError):  # answered in order, and the session is over
                    session.detachable = False
                    await writer.error(session, frame, terminal=True)
                    return
                if not await self._work(session, frame, writer, ctl):
                    return
        finally:
            await writer.close(self.limits.step_timeout / 10)
            if reader is not None:
                reader.cancel()  # its outcome is collected here either way
                with contextlib.suppress(BaseException):
                    await reader
            # the transport cancels this task when the peer hangs up (initiators do, right after an
            # error reply); a clean-up cut short would leak the KV slot: let it run to its end
            await asyncio.shield(self._end(session))

    async def _read_ahead(self, stream: Stream, session: HopSession,
                          queue: asyncio.Queue[pb.SessionFrame | errors.MeshnodeError | None],
                          writer: ReplyWriter, ctl: Control) -> None:
        """Read frames as they come: credits and refusals act at once, the rest is queued in order.

        Bytes that are not a SessionFrame end the reading: PAYLOAD_CORRUPT is queued (the stream's
        framing can no longer be trusted) and a running Generate stops after its current step.
        """
        try:
            while True:
                try:
                    frame = await stream.read()
                except errors.WireError as e:
                    ctl.stop.set()
                    queue.put_nowait(e)
                    return
                if frame is None:
                    return
                self.metrics.bytes_in.inc(frame.ByteSize())
                kind = frame.WhichOneof("body")
                try:
                    if frame.route_epoch != session.epoch:  # every body, before it acts
                        raise errors.EpochStaleError(
                            f"route epoch {frame.route_epoch} is stale (session is at {session.epoch})")
                    if kind == "credit":
                        ctl.flow.grant(frame.credit.credits)
                        continue
                    if ctl.generating and kind not in ("cancel", "release"):
                        raise errors.SessionError("a Generate is running on this session")
                    if kind == "step":
                        ctl.flow.admit()
                    elif kind == "generate":
                        ctl.generating, ctl.stop, ctl.work_id = True, asyncio.Event(), frame.generate.work_id
                    elif kind == "release" or (kind == "cancel" and frame.cancel.work_id in ("", ctl.work_id)):
                        ctl.stop.set()  # a running Generate ends after its current step
                    if kind == "cancel" and frame.cancel.work_id:
                        session.cancelled_work.add(frame.cancel.work_id)
                except errors.MeshnodeError as e:
                    if isinstance(e, errors.FlowControlError):
                        ctl.overruns += 1
                        if admission.overrun(ctl.overruns, self.limits.max_overruns):  # cut: the peer ignores credits
                            ctl.stop.set()
                            queue.put_nowait(errors.FlowControlError(
                                f"{ctl.overruns} frames beyond the negotiated credits: the stream is cut"))
                            return
                    await writer.write(pb.SessionReply(route_session_id=session.session_id, error=codec.error_to_pb(
                        e, hop=self.endpoint, step_id=frame.step.step_id if kind == "step" else 0, terminal=False)))
                    continue
                queue.put_nowait(frame)
        finally:
            queue.put_nowait(None)

    async def _work(self, session: HopSession, frame: pb.SessionFrame, writer: ReplyWriter, ctl: Control) -> bool:
        """Execute one queued frame; False once the session is over."""
        kind = frame.WhichOneof("body")
        # The state a frame holds is given back *before* its final answer is written: the peer
        # may send the next step or Generate the moment it reads that answer, and the reader
        # must not refuse it for credits or a Generate that are in fact over.
        if kind == "generate":
            try:
                return await self._generate(session, frame, writer, ctl)
            finally:
                ctl.generating, ctl.work_id = False, None
        if kind != "step":
            return await self._frame(session, frame, writer)
        return await self._step(session, frame, writer, ctl)

    async def _step(self, session: HopSession, frame: pb.SessionFrame, writer: ReplyWriter, ctl: Control) -> bool:
        """Start a step; its reply is queued in order and written once the hops after this one answered
        (``HopSession.start``), so the next step may start here meanwhile. False once the session is over."""
        answered = False

        def answer() -> None:
            nonlocal answered
            if not answered:
                answered = True
                ctl.flow.answered()

        try:
            self._check_live(session, frame)
            rest = await session.start(frame)
        except Exception as e:
            reply = self._failed(session, e, frame.step.step_id)
            writer.post(reply, answer)
            return not reply.error.terminal
        except BaseException:
            answer()
            raise
        writer.post_later(self._settle(session, frame, rest, ctl), answer)
        return True

    async def _settle(self, session: HopSession, frame: pb.SessionFrame, rest: Awaitable[pb.SessionReply],
                      ctl: Control) -> pb.SessionReply:
        """A started step's reply once the next hop answered; an error reply if it failed (never raises)."""
        try:
            return await rest
        except Exception as e:
            reply = self._failed(session, e, frame.step.step_id)
            if reply.error.terminal:
                ctl.end()
            return reply

    def _failed(self, session: HopSession, e: Exception, step_id: int) -> pb.SessionReply:
        """The answer to a step that raised ``e`` (call it in the ``except``): a MeshnodeError's own
        code; anything else is a bug: logged, answered INTERNAL (terminal), and not resumable."""
        if not isinstance(e, errors.MeshnodeError):
            log.exception("internal error in session %s", session.session_id)
            session.detachable = False
            e = errors.MeshnodeError(f"internal error: {e!r}")
            return pb.SessionReply(route_session_id=session.session_id, error=codec.error_to_pb(
                e, hop=self.endpoint, step_id=step_id, terminal=True))
        return pb.SessionReply(route_session_id=session.session_id,
                               error=codec.error_to_pb(e, hop=self.endpoint, step_id=step_id))

    async def _generate(self, session: HopSession, frame: pb.SessionFrame, writer: ReplyWriter, ctl: Control) -> bool:
        def over() -> None:
            ctl.generating, ctl.work_id = False, None

        def post(reply: pb.SessionReply) -> None:
            if reply.HasField("result") and reply.result.last:
                over()
            writer.post(reply)

        try:
            await session.generate(frame, post, ctl.stop, ctl.flow)
        except errors.MeshnodeError as e:
            over()
            await writer.error(session, e)
            return not codec.error_to_pb(e, hop=self.endpoint).terminal
        except Exception as e:
            over()
            log.exception("internal error in session %s", session.session_id)
            session.detachable = False
            await writer.error(session, errors.MeshnodeError(f"internal error: {e!r}"), terminal=True)
            return False
        return True

    async def _open(self, session: HopSession, frame: pb.SessionFrame, context: ReplyWriter) -> bool:
        sid = frame.route_session_id
        try:
            if not frame.HasField("open"):
                raise errors.UnknownSessionError(f"session {sid!r} was never opened on this hop")
            if not self.serving:
                raise errors.CapacityError("this node is draining and takes no new sessions")
            if sid in self.cancelled:
                if self._cancelled_by_its_initiator(frame):
                    raise errors.CancelledError(f"session {sid} was cancelled before it opened")
                self.cancelled.discard(sid)  # someone else's cancel: void for this session
                self.early_cancellers.pop(sid, None)
            prior = await self._claim(sid, frame) if frame.open.resume else None
            if sid in self.sessions:
                raise errors.SessionError(f"session {sid} is already open on this hop")
            if prior is None:
                await self.sweep()
                await self._make_room()
            try:
                accepted = await session.open(frame, prior)
            except BaseException:
                if prior is not None and prior.slot is not None:  # not adopted: keep it for a valid resume
                    self.detached[sid] = prior
                raise
        except errors.MeshnodeError as e:
            await context.write(pb.SessionReply(route_session_id=sid, error=codec.error_to_pb(
                e, hop=self.endpoint, terminal=True)))
            return False
        session.detachable = True
        self.sessions[sid] = session
        self.metrics.sessions.inc()
        await context.write(pb.SessionReply(route_session_id=sid, accepted=accepted))
        return True

    def _cancelled_by_its_initiator(self, frame: pb.SessionFrame) -> bool:
        """An early cancel binds only an open by the same initiator."""
        canceller = self.early_cancellers.get(frame.route_session_id)
        if canceller is None:
            return True  # cancelled in-band or after its open
        try:
            return parse_open(frame.open.signed_open).initiator_node_id == canceller
        except errors.MeshnodeError:
            return True  # a forged open is refused anyway

    def _check_live(self, session: HopSession, frame: pb.SessionFrame) -> None:
        sid = session.session_id
        if frame.route_session_id != sid:
            raise errors.SessionError(f"frame for session {frame.route_session_id!r} on the stream of {sid!r}")
        if sid in self.cancelled or sid not in self.sessions:
            raise errors.CancelledError(f"session {sid} was cancelled or released")

    async def _frame(self, session: HopSession, frame: pb.SessionFrame, context: ReplyWriter) -> bool:
        """Answer one control frame (cancel, release); False once the session is over."""
        sid = session.session_id
        kind = frame.WhichOneof("body")
        try:
            self._check_live(session, frame)
            if kind == "cancel":
                if not frame.cancel.work_id:
                    session.detachable = False
                await session.relay(frame)
                if frame.cancel.work_id:
                    session.cancelled_work.add(frame.cancel.work_id)
                    reply = pb.SessionReply(route_session_id=sid, error=codec.error_to_pb(
                        errors.CancelledError(f"work item {frame.cancel.work_id} cancelled"),
                        hop=self.endpoint, terminal=False))
                else:  # freed before the answer, as a release is: an initiator may hang up at once
                    await session.close()
                    await context.write(pb.SessionReply(route_session_id=sid, error=codec.error_to_pb(
                        errors.CancelledError("session cancelled"), hop=self.endpoint, terminal=True)))
                    return False
            elif kind == "release":
                session.detachable = False
                await session.relay(frame)
                await session.close()
                await context.write(pb.SessionReply(route_session_id=sid, released=True))
                return False
            else:
                raise errors.SessionError(f"unexpected frame {kind!r} inside an open session")
        except errors.MeshnodeError as e:
            err = codec.error_to_pb(e, hop=self.endpoint)
            await context.write(pb.SessionReply(route_session_id=sid, error=err))
            return not err.terminal
        except Exception as e:  # a bug: answer, log, keep serving others
            log.exception("internal error in session %s", sid)
            session.detachable = False
            await context.write(pb.SessionReply(route_session_id=sid, error=codec.error_to_pb(
                errors.MeshnodeError(f"internal error: {e!r}"), hop=self.endpoint, terminal=True)))
            return False
        await context.write(reply)
        return True
