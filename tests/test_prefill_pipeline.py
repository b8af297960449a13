"""Prefill pipelined by chunk: hop i + 1 computes chunk k while hop i computes chunk k + 1.

(Pipelined only when hops computing at once would not run more threads than their machine's cores:
``routing/overlap.py``, tested here too.)

The initiator sends prompt chunks up to the negotiated credits ahead, and a hop
takes its next chunk as soon as it has passed the last one on, not when the
next hop has answered it. Shown without any clock: the tail is frozen
(SIGSTOP) and the head still computes every chunk; thawed, the route answers
with the whole model's tokens. A tail killed while the head is chunks ahead of
it is replaced by a spare, the positions the head holds beyond what the
initiator saw answered are cut at the resume, and the text is unchanged.
"""

from __future__ import annotations

import asyncio
import os
import signal

import trio

from meshnode.capabilities import host_id
from meshnode.identity import NodeIdentity
from meshnode.routing.overlap import overcommitted
from meshnode.session.initiator import GenerateConfig, RouteSession, check_route, generate
from meshnode.transport.client import get_capability, health
from tests.conftest import aio, llama_reference
from tests.test_context import PASSAGES

#: three 512-token chunks (the nodes' n_batch), the last one short
PROMPT = " ".join(PASSAGES * 12)
N_TOKENS = 8
N_CTX = 2048


def _chunks(tokens: list[int], n: int = 512) -> list[list[int]]:
    return [tokens[i : i + n] for i in range(0, len(tokens), n)]


async def _head_runs_ahead(peers: list[str], tail_pid: int, prompt_tokens: list[int]) -> dict[str, object]:
    """Open a route, freeze the tail, prefill: the head computes every chunk while the tail is frozen."""
    seen: dict[str, object] = {}
    caps = await check_route(peers)
    rs = RouteSession(peers, caps, GenerateConfig(prompt="", max_tokens=1, step_timeout=120), NodeIdentity.generate())
    chunks = _chunks(prompt_tokens)
    try:
        accepted = await rs.open()
        seen["credits"] = accepted.limits.credits
        before = (await health(peers[0], 5.0)).steps_total
        os.kill(tail_pid, signal.SIGSTOP)
        try:
            task = asyncio.ensure_future(rs.prefill(chunks))
            async with asyncio.timeout(100):  # a hang guard, not a timing assertion
                while (await health(peers[0], 5.0)).steps_total - before < len(chunks):
                    assert not task.done(), task
                    await asyncio.sleep(0.05)
            seen["head_steps_while_tail_frozen"] = (await health(peers[0], 5.0)).steps_total - before
        finally:
            os.kill(tail_pid, signal.SIGCONT)
        result = await task
        seen["token"] = result.token
        seen["n_past"] = rs.n_past
        seen["history"] = [len(c) for c in rs.history]
        await rs.release()
    finally:
        await rs.close()
    return seen


async def test_the_head_computes_every_chunk_while_the_tail_is_frozen(model, node_factory):
    ref = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, 1, N_CTX, via_generate=False))
    assert len(ref.prompt_tokens) > 2 * 512  # three chunks
    head = await trio.to_thread.run_sync(node_factory, "0:15")
    tail = await trio.to_thread.run_sync(node_factory, "15:30")
    with trio.fail_after(300):
        seen = await aio(_head_runs_ahead, [head.endpoint, tail.endpoint], tail.proc.pid, ref.prompt_tokens)
    assert seen["credits"] >= 3
    assert seen["head_steps_while_tail_frozen"] == 3
    assert seen["history"] == [len(c) for c in _chunks(ref.prompt_tokens)]
    assert seen["n_past"] == len(ref.prompt_tokens)
    assert seen["token"] == ref.tokens[0]


async def _kill_while_ahead(peers: list[str], spare: str, tail: object, prompt: str) -> object:
    """Generate with the tail frozen and killed once the head is three chunks ahead of it."""
    caps_before = (await health(peers[0], 5.0)).steps_total
    cfg = GenerateConfig(prompt=prompt, max_tokens=N_TOKENS, step_timeout=120)
    task = asyncio.ensure_future(generate(peers, cfg, NodeIdentity.generate(), spares=[spare]))
    proc = tail.proc  # type: ignore[attr-defined]
    async with asyncio.timeout(100):  # a hang guard
        while (await health(peers[1], 5.0)).live_sessions < 1:  # the route is open
            assert not task.done(), task
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)
        while (await health(peers[0], 5.0)).steps_total - caps_before < 3:
            assert not task.done(), task
            await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    return await task


def _two_cpus() -> tuple[list[int], list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "this test gives the head and the tail a CPU each (taskset): it needs two"
    return [cpus[0]], [cpus[-1]]


async def test_a_tail_killed_behind_a_head_chunks_ahead_is_replaced_and_the_text_is_unchanged(model, node_factory):
    ref = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, N_TOKENS, N_CTX, via_generate=False))
    # a CPU each, as on machines of their own: ``generate`` pipelines only hops that would not overcommit
    # their CPUs (unpinned on one machine, two prefill teams of all its cores each would)
    head_cpus, tail_cpus = _two_cpus()
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", cpus=head_cpus))
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", cpus=tail_cpus))
    spare = await trio.to_thread.run_sync(lambda: node_factory("15:30", cpus=tail_cpus))
    with trio.fail_after(300):
        result = await aio(_kill_while_ahead, [head.endpoint, tail.endpoint], spare.endpoint, tail, PROMPT)
    assert result.prompt_tokens == ref.prompt_tokens
    assert result.tokens == ref.tokens
    assert [f["hop"] for f in result.failovers] == [tail.endpoint]
    assert result.route == [head.endpoint, spare.endpoint]


def test_hops_overcommit_only_a_machine_whose_shared_cpus_they_outnumber() -> None:
    assert overcommitted([("h1", [0, 1], 2), ("h1", [0, 1], 2)])  # one 2-CPU machine, 2 threads each
    assert not overcommitted([("h1", [0, 1], 1), ("h1", [0, 1], 1)])  # 1 thread each fits 2 CPUs
    assert not overcommitted([("h1", [0], 1), ("h1", [1], 1)])  # one machine, disjoint cpusets (taskset)
    assert not overcommitted([("h1", [0, 1], 2), ("h2", [0, 1], 2)])  # two machines
    assert not overcommitted([("", [0], 4), ("", [0], 4)])  # unknown machines: taken as machines of their own
    assert not overcommitted([("h1", [0], 0), ("h1", [0], 0)])  # threads unknown
    assert overcommitted([("h2", [0], 1), ("h1", [3], 1), ("h1", [2, 3], 2)])  # any hops of the route
    assert overcommitted([("h1", [0, 1], 1), ("h1", [1, 2], 1), ("h1", [2], 2)])  # overlapping, transitively
    assert not overcommitted([("h1", [0], 2)])  # one hop alone computes alone


async def _hardware(endpoints: list[str]) -> list[object]:
    return [(await get_capability(e)).hardware for e in endpoints]


async def test_nodes_advertise_their_machine_and_cpus(node_factory):
    head_cpus, tail_cpus = _two_cpus()
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", cpus=head_cpus))
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", cpus=tail_cpus))
    with trio.fail_after(60):
        hw = await aio(_hardware, [head.endpoint, tail.endpoint])
    assert list(hw[0].cpus) == head_cpus
    assert list(hw[1].cpus) == tail_cpus
    assert hw[0].host_id == hw[1].host_id == host_id() != ""
    assert hw[0].decode_threads == hw[1].decode_threads == 1  # half the physical cores of one CPU, at least 1
    assert hw[0].batch_threads == hw[1].batch_threads == 1  # the CPUs it may use
