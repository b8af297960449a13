"""Eight concurrent sessions on one two-hop route of real node processes.

Both hops run ``meshnode serve --max-sessions 8``. One initiator (this
process, one trio_asyncio loop, one trio task per session) first runs each of
eight prompts alone on the route -- each must equal llama-cpp-python
``Llama``'s greedy tokens and logits -- and then runs all eight at once. The
hops batch the sessions' decode steps (Health: ``batches_total`` grows less
than ``steps_total``), and every session gets exactly what it got alone:

* four run to the end: three through delegated decode (``generate``, the head
  runs the loop), one step by step from here;
* four are ended mid-way, after a few tokens, while the others decode:
  an in-band cancel frame during a delegated Generate, an in-band release
  frame during a delegated Generate, an out-of-band ``Cancel`` RPC and an
  out-of-band ``Release`` RPC (both signed by the session's initiator) between
  two steps of a step-by-step session. Each ends cleanly (typed CANCELLED, or
  ``released``), and the tokens it got before are its solo output's prefix.
  (The out-of-band order goes to the head only: a hop that ends a session
  sends a release on to the hops after it, so the whole route frees it;
  merely hanging up would leave them holding it detached for a resume.)

Afterwards every node's ``live_sessions`` returns to 0, and a fresh session
on the freed slots again gets the solo output.

Below that, the executor under the same races, made deterministic by holding
its worker thread: a step whose waiter is cancelled (grpc cancels a handler
whose client went away) never runs if it has not started, and runs to
completion if it has, and neither wedges the queue; a release whose waiter is
cancelled still frees the slot; a chunk still queued when its session is
released is refused rather than written into the freed slot.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio_asyncio

from meshnode import errors
from meshnode.executor.api import RangeExecutor
from meshnode.executor.config import ExecConfig
from meshnode.gguf.slicer import ensure_range
from meshnode.identity import NodeIdentity
from meshnode.identity.routeauth import sign_control
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.runtime.launch import NodeProcess
from meshnode.session.initiator import GenerateConfig, GenerationResult, RouteSession, check_route, generate
from meshnode.transport.client import health, open_channel, tokenize
from meshnode.wire.tensors import decode_bundle
from tests.conftest import Reference, aio, llama_reference

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Paris is the capital of",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived",
    "The quick brown fox",
    "import numpy as",
    "Water boils at a temperature of",
]
N_TOKENS = 24
#: tokens an interrupted session gets before its cancel / release is sent
CUT_AFTER = 3
#: what each session does in the concurrent phase (index = prompt index)
MODES = ["delegated", "delegated", "stepwise", "delegated",
         "cancel_in_band", "release_in_band", "cancel_oob", "release_oob"]


@dataclass
class Outcome:
    tokens: list[int]
    logits: list[np.ndarray] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    #: how it ended: "complete", "CANCELLED" (a typed CancelledError) or "released"
    end: str = ""
    #: each hop's reply to the out-of-band RPC (cancelled / released), if one was sent
    oob_acks: list[bool] = field(default_factory=list)
    #: the hop that reported the CANCELLED error
    error_hop: str | None = None
    #: a Generate's final result said ``last``
    last_flag: bool = False
    #: steps it sampled (its tokens, plus the end-of-generation token, which is not one of them)
    n_sampled: int = 0


def _logits(result: pb.StepResult) -> np.ndarray:
    return decode_bundle(result.logits, n_cols=result.logits.shape[1])[0]


async def _solo(peers: list[str], prompt: str, ident: NodeIdentity, *, delegate: bool = True) -> Outcome:
    cfg = GenerateConfig(prompt=prompt, max_tokens=N_TOKENS, return_logits=True, delegate=delegate)
    r: GenerationResult = await generate(peers, cfg, ident)
    return Outcome(r.tokens, r.logits, r.prompt_tokens, "complete", n_sampled=len(r.tokens) + (r.stop_reason == "eog"))


async def _interrupted(peers: list[str], caps: list[pb.Capability], prompt: str, ident: NodeIdentity,
                       mode: str) -> Outcome:
    """Open a session, decode CUT_AFTER tokens, then end it the way ``mode`` says."""
    ids = await tokenize(peers[-1], prompt)
    rs = RouteSession(peers, caps, GenerateConfig(prompt=prompt, max_tokens=N_TOKENS, return_logits=True), ident)
    out = Outcome([], prompt_tokens=ids)
    try:
        await rs.open()
        first = await rs.step(ids, sample=True)
        out.tokens.append(first.token)
        out.logits.append(_logits(first))
        if mode.endswith("in_band"):
            # delegated decode; the control frame goes in while the head's Generate runs
            body = ({"cancel": pb.CancelSignal()} if mode == "cancel_in_band" else {"release": pb.ReleaseSignal()})
            async for r in rs.generate(first.token, N_TOKENS - 1):
                out.tokens.append(r.token)
                out.logits.append(_logits(r))
                out.last_flag = r.last
                if len(out.tokens) == CUT_AFTER:
                    await rs._write(pb.SessionFrame(route_session_id=rs.id, route_epoch=rs.epoch, **body))
            # the head ends the Generate after its current step (that result says `last`),
            # then answers the control frame
            try:
                reply = await rs._read()
                out.end = "released" if reply.released else f"unexpected reply {reply}"
            except errors.CancelledError as e:
                out.end, out.error_hop = "CANCELLED", e.hop
                # the head freed the session before it answered: hanging up at once (rs.close) leaks
                # nothing, which _wait_idle below checks
        else:
            while len(out.tokens) < CUT_AFTER:
                r = await rs.step([out.tokens[-1]], sample=True)
                out.tokens.append(r.token)
                out.logits.append(_logits(r))
            # out of band, to the head only: it ends the session on the hops after it too
            action = "cancel" if mode == "cancel_oob" else "release"
            order = sign_control(ident, rs.id, action, now=int(time.time()))
            for peer in peers[:1]:
                async with await open_channel(peer) as ch:
                    stub = pb_grpc.NodeStub(ch)
                    if action == "cancel":
                        reply = await stub.Cancel(pb.CancelRequest(route_session_id=rs.id, auth=order))
                        out.oob_acks.append(reply.cancelled)
                    else:
                        released = await stub.Release(pb.ReleaseRequest(route_session_id=rs.id, auth=order))
                        out.oob_acks.append(released.released)
            # the session is gone at the head: the next step is refused, typed
            try:
                r = await rs.step([out.tokens[-1]], sample=True)
                out.end = f"a step after the {action} ran: token {r.token}"
            except errors.CancelledError as e:
                out.end = "released" if action == "release" else "CANCELLED"
                out.error_hop = e.hop
    finally:
        await rs.close()
    return out


async def _wait_idle(endpoint: str, timeout: float = 20.0) -> pb.HealthReply:
    """Health, once the node holds no session any more (bounded: fails the test after ``timeout``)."""
    h: pb.HealthReply = await trio_asyncio.aio_as_trio(health)(endpoint)
    with trio.move_on_after(timeout):
        while h.live_sessions:
            await trio.sleep(0.05)
            h = await trio_asyncio.aio_as_trio(health)(endpoint)
    assert h.live_sessions == 0, (f"{endpoint} still holds {h.live_sessions} sessions "
                                  f"({h.detached_sessions} detached) after {timeout}s")
    return h


def _delta(after: pb.HealthReply, before: pb.HealthReply) -> dict[str, int]:
    return {k: getattr(after, k) - getattr(before, k) for k in ("steps_total", "batches_total", "tokens_total")}


async def test_eight_concurrent_sessions_batch_and_each_equals_its_solo_run(
    model: Path, node_factory: Callable[..., NodeProcess]
) -> None:
    refs: list[Reference] = [await trio.to_thread.run_sync(llama_reference, model, p, N_TOKENS) for p in PROMPTS]
    nodes = [await trio.to_thread.run_sync(lambda c=c: node_factory(c, extra=("--max-sessions", "8")))
             for c in ("0:15", "15:30")]
    peers = [n.endpoint for n in nodes]
    ident = NodeIdentity.generate()
    concurrent: dict[int, Outcome] = {}

    async def one(i: int, caps: list[pb.Capability]) -> None:
        mode, prompt = MODES[i], PROMPTS[i]
        if mode in ("delegated", "stepwise"):
            concurrent[i] = await trio_asyncio.aio_as_trio(_solo)(peers, prompt, ident, delegate=mode == "delegated")
        else:
            concurrent[i] = await trio_asyncio.aio_as_trio(_interrupted)(peers, caps, prompt, ident, mode)

    # one asyncio loop for all grpc work: grpc.aio's poller belongs to one loop
    with trio.fail_after(240):
        async with trio_asyncio.open_loop():
            caps = await trio_asyncio.aio_as_trio(check_route)(peers)
            assert [c.max_sessions for c in caps] == [8, 8]
            solo = [await trio_asyncio.aio_as_trio(_solo)(peers, p, ident) for p in PROMPTS]
            before = [await _wait_idle(p) for p in peers]
            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i, caps)
            after = [await _wait_idle(p) for p in peers]
            # a fresh session on the freed slots (one of them was cancelled mid-way)
            again = await trio_asyncio.aio_as_trio(_solo)(peers, PROMPTS[4], ident)
            final = [await _wait_idle(p) for p in peers]

    # alone on the route, each prompt gives exactly the whole model's tokens and logits
    for ref, s in zip(refs, solo, strict=True):
        assert s.prompt_tokens == ref.prompt_tokens
        assert s.tokens == ref.tokens
        assert len(s.logits) == len(ref.logits)
        for got, want in zip(s.logits, ref.logits, strict=True):
            assert np.array_equal(got, want)
    assert len({tuple(s.tokens) for s in solo}) == len(PROMPTS)  # distinct outputs: cross-talk would show

    for i, mode in enumerate(MODES):
        got, want = concurrent[i], solo[i]
        assert got.prompt_tokens == want.prompt_tokens, mode
        if mode in ("delegated", "stepwise"):
            assert got.end == "complete"
            assert got.tokens == want.tokens, (i, mode)
        else:
            # ended mid-way: fewer tokens than alone, and exactly the solo run's first ones
            assert CUT_AFTER <= len(got.tokens) < len(want.tokens), (i, mode, got.tokens)
            assert got.tokens == want.tokens[: len(got.tokens)], (i, mode)
            expected_end = "CANCELLED" if mode.startswith("cancel") else "released"
            assert got.end == expected_end, (i, mode)
            if got.end == "CANCELLED":
                assert got.error_hop == peers[0]
            if mode.endswith("in_band"):
                assert got.last_flag  # the head's Generate closed its stream of results cleanly
            else:
                assert got.oob_acks == [True]
                assert len(got.tokens) == CUT_AFTER  # nothing ran after the out-of-band order
        for a, b in zip(got.logits, want.logits, strict=False):
            assert np.array_equal(a, b), (i, mode)
        assert len(got.logits) == len(got.tokens)
    assert again.tokens == solo[4].tokens
    for a, b in zip(again.logits, solo[4].logits, strict=True):
        assert np.array_equal(a, b)

    # every step of every session ran exactly once on each hop, and the hops batched them
    n_results = sum(o.n_sampled or len(o.tokens) for o in concurrent.values())
    n_positions = sum(len(o.prompt_tokens) + (o.n_sampled or len(o.tokens)) - 1 for o in concurrent.values())
    for endpoint, b, a in zip(peers, before, after, strict=True):
        d = _delta(a, b)
        assert d["steps_total"] == n_results, (endpoint, d)
        assert d["tokens_total"] == n_positions, (endpoint, d)
        assert 0 < d["batches_total"] < d["steps_total"], (endpoint, d)
    for h in (*after, *final):
        assert h.live_sessions == 0
        assert h.free_sessions == 8
        assert h.serving
    for n in nodes:
        assert n.proc.poll() is None  # no node died on the way
        assert "Traceback" not in n.stderr()


# -- the executor under cancellation -----------------------------------------------------------------------


def _executor(model: Path) -> RangeExecutor:
    return RangeExecutor(ensure_range(model, 0, 12), ExecConfig(max_sessions=4))


def _held(ex: RangeExecutor) -> threading.Event:
    """Hold the executor's worker thread until the returned event is set (its pool is private)."""
    gate = threading.Event()
    ex._pool.submit(gate.wait)
    return gate


def _toks(n: int) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.int32)


async def _wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``cond`` on the asyncio side (bounded); whether it came true."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True


async def _run_then_close(ex: RangeExecutor, go: Callable[[], Any]) -> dict[str, Any]:
    """Run the asyncio coroutine ``go()`` (bounded), then close the executor whatever happened."""
    try:
        with trio.fail_after(60):
            out: dict[str, Any] = await aio(go)
            return out
    finally:
        ex.close()


async def test_a_step_cancelled_before_it_starts_never_runs(model: Path) -> None:
    ex = await trio.to_thread.run_sync(_executor, model)

    async def go() -> dict[str, Any]:
        a, b = ex.open_slot(), ex.open_slot()
        gate = _held(ex)
        gone = asyncio.ensure_future(ex.forward(a, 0, tokens=_toks(3)))
        await asyncio.sleep(0)  # queued behind the held worker
        gone.cancel()
        other = asyncio.ensure_future(ex.forward(b, 0, tokens=_toks(3)))  # would batch with it
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.wait([other]), 30)
        return {"gone_cancelled": gone.cancelled(), "other": other.exception(), "pos_a": ex.next_pos(a),
                "pos_b": ex.next_pos(b), "steps": ex.steps_total, "batches": ex.batches_total}

    r = await _run_then_close(ex, go)
    assert r["gone_cancelled"]
    assert r["other"] is None
    assert r["pos_a"] == 0  # the cancelled chunk ran nothing
    assert r["pos_b"] == 3
    assert (r["steps"], r["batches"]) == (1, 1)


async def test_a_step_cancelled_while_its_batch_runs_completes_and_the_queue_goes_on(model: Path) -> None:
    ex = await trio.to_thread.run_sync(_executor, model)
    running, gate = threading.Event(), threading.Event()
    real = ex._range.forward_many

    def held_forward_many(chunks: list[Any]) -> list[Any]:  # holds the batch inside the worker
        running.set()
        gate.wait()
        return real(chunks)

    async def go() -> dict[str, Any]:
        a, b = ex.open_slot(), ex.open_slot()
        ex._range.forward_many = held_forward_many  # type: ignore[method-assign]
        gone = asyncio.ensure_future(ex.forward(a, 0, tokens=_toks(3)))
        started = await _wait_for(running.is_set)
        gone.cancel()  # as grpc cancels a handler mid-step when its client goes away
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        gate.set()
        nxt = asyncio.ensure_future(ex.forward(b, 0, tokens=_toks(2)))
        done, _ = await asyncio.wait([nxt], timeout=30)
        return {"started": started, "gone_cancelled": gone.cancelled(), "drains": bool(done),
                "pos_a": ex.next_pos(a), "pos_b": ex.next_pos(b)}

    try:
        with trio.fail_after(60):
            r = await aio(go)
    finally:
        gate.set()
        ex._range.forward_many = real  # type: ignore[method-assign]
        ex.close()
    assert r["started"]
    assert r["gone_cancelled"]
    assert r["drains"], "the executor stopped draining after a step was cancelled mid-batch"
    assert r["pos_a"] == 3  # it had started: it ran to completion (KV consistent with next_pos)
    assert r["pos_b"] == 2


async def test_a_release_whose_wait_is_cancelled_still_frees_the_slot(model: Path) -> None:
    ex = await trio.to_thread.run_sync(_executor, model)

    async def go() -> dict[str, Any]:
        a = ex.open_slot()
        await ex.forward(a, 0, tokens=_toks(3))
        gate = _held(ex)
        rel = asyncio.ensure_future(ex.release(a))
        await asyncio.sleep(0)  # the release is queued behind the held worker
        rel.cancel()
        gate.set()
        freed = await _wait_for(lambda: ex.free_slots == 4)
        return {"freed": freed, "pos_a": ex.next_pos(a)}

    r = await _run_then_close(ex, go)
    assert r["freed"], "a cancelled release leaked its slot"
    assert r["pos_a"] == 0


async def test_a_chunk_queued_when_its_session_is_released_is_refused(model: Path) -> None:
    ex = await trio.to_thread.run_sync(_executor, model)

    async def go() -> dict[str, Any]:
        a, b = ex.open_slot(), ex.open_slot()
        gate = _held(ex)
        fb = asyncio.ensure_future(ex.forward(b, 0, tokens=_toks(3)))
        fa = asyncio.ensure_future(ex.forward(a, 0, tokens=_toks(5)))  # another length: a later batch
        await asyncio.sleep(0)
        rel = asyncio.ensure_future(ex.release(a))  # the session of slot a ends meanwhile
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.wait([fa, fb, rel]), 30)
        return {"fa": fa.exception(), "fb": fb.exception(), "pos_a": ex.next_pos(a), "free": ex.free_slots,
                "reopened": ex.open_slot()}

    r = await _run_then_close(ex, go)
    assert isinstance(r["fa"], errors.CancelledError)
    assert r["fb"] is None
    assert r["pos_a"] == 0  # nothing was written into the freed slot
    assert r["free"] == 3
    assert r["reopened"] == 0
