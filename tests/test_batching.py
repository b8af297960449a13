"""Cross-session batching on real llama.cpp: one llama_decode for several sessions'
steps gives every session exactly what it gets alone (head, middle-capture and tail)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import trio
import trio_asyncio

from meshnode.errors import CacheMissError, ExecutorError, ShapeError
from meshnode.executor._llama import Chunk, LlamaRange, batchable
from meshnode.executor.api import (
    MOST_WAIT_ITERATIONS,
    QUIET_ITERATIONS,
    RangeExecutor,
    group_of,
    pick_batch,
    settled,
)
from meshnode.executor.config import ExecConfig
from meshnode.gguf.slicer import ensure_range

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,", "Once upon a time", "The quick brown fox", "import numpy as", "Water boils at"]
N_DECODE = 6
CUT = 12


def test_pick_batch_takes_equal_lengths_of_distinct_sessions() -> None:
    assert pick_batch([], 512) == []
    assert pick_batch([(0, 1), (1, 1), (0, 1), (2, 7), (3, 1)], 512) == [0, 1, 4]
    assert pick_batch([(5, 7), (1, 1), (2, 7)], 512) == [0, 2]
    assert pick_batch([(0, 300), (1, 300)], 512) == [0]  # would span two micro-batches
    assert pick_batch([(2, 1), (4, 1), (3, 1), (0, 1), (1, 1)], 512, 3, among={0, 1, 2, 3}) == [0, 2, 3]


def test_groups_are_runs_of_consecutive_live_slots() -> None:
    # llama.cpp runs one batch over consecutive sequences only: a hop's groups are blocks of its live slots
    assert group_of(range(8), 5, 4) == [4, 5, 6, 7]
    assert group_of(range(8), 0, 4) == [0, 1, 2, 3]
    assert group_of([0, 1, 5, 6, 7], 5, 2) == [5, 6]
    assert group_of([0, 1, 5, 6, 7], 7, 2) == [7]
    assert group_of([0, 1], 3, 2) == [3]  # not live: alone


def test_a_slot_is_the_one_preferred_when_free(model: Path) -> None:
    ex = RangeExecutor(ensure_range(model, 0, CUT), ExecConfig(max_sessions=4))
    try:
        assert ex.open_slot(2) == 2
        assert ex.open_slot() == 0  # no preference: the lowest free
        assert ex.open_slot(2) == 1  # taken: the lowest free
        assert ex.open_slot(99) == 3  # out of range: a hint, never an error
    finally:
        ex.close()
    assert batchable([4, 4], 8)
    assert not batchable([4, 4], 7)
    assert not batchable([1, 2], 512)


def _prompts(tail: LlamaRange) -> list[np.ndarray]:
    assert tail.vocab is not None
    return [np.asarray(tail.vocab.tokenize(p), dtype=np.int32) for p in PROMPTS]


def _solo(head: LlamaRange, tail: LlamaRange, toks: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    step, pos = toks, 0
    for _ in range(N_DECODE):
        res = head.forward(0, pos, tokens=step).residual
        out = tail.forward(0, pos, embd=res).logits
        assert out is not None
        pos += len(step)
        logits.append(out)
        tokens.append(int(np.argmax(out)))
        step = np.asarray(tokens[-1:], dtype=np.int32)
    head.release(0)
    tail.release(0)
    return tokens, logits


@pytest.fixture(scope="module")
def pair(model: Path) -> tuple[LlamaRange, LlamaRange]:
    n = 30
    cfg = ExecConfig(max_sessions=8)
    return LlamaRange(ensure_range(model, 0, CUT), cfg), LlamaRange(ensure_range(model, CUT, n), cfg)


def test_batched_decode_equals_each_session_alone(pair: tuple[LlamaRange, LlamaRange]) -> None:
    head, tail = pair
    prompts = _prompts(tail)
    solo = [_solo(head, tail, p) for p in prompts]
    # prefill each session alone (prompts differ in length), then decode all 8 in one batch per step
    pos = [0] * len(prompts)
    last: list[int] = []
    got: list[list[np.ndarray]] = [[] for _ in prompts]
    for s, p in enumerate(prompts):
        res = head.forward(s, 0, tokens=p).residual
        out = tail.forward(s, 0, embd=res).logits
        assert out is not None
        got[s].append(out)
        last.append(int(np.argmax(out)))
        pos[s] = len(p)
    for _ in range(N_DECODE - 1):
        hs = head.forward_many([Chunk(s, pos[s], tokens=np.asarray([last[s]], np.int32)) for s in range(8)])
        rs = [h.residual for h in hs if not isinstance(h, Exception)]
        assert len(rs) == 8
        ts = tail.forward_many([Chunk(s, pos[s], embd=rs[s]) for s in range(8)])
        for s, t in enumerate(ts):
            assert not isinstance(t, Exception)
            assert t.logits is not None
            got[s].append(t.logits)
            last[s] = int(np.argmax(t.logits))
            pos[s] += 1
    for s in range(8):
        assert [int(np.argmax(x)) for x in got[s]] == solo[s][0]
        for a, b in zip(got[s], solo[s][1], strict=True):
            np.testing.assert_array_equal(a, b)
        head.release(s)
        tail.release(s)


def test_a_bad_chunk_fails_alone(pair: tuple[LlamaRange, LlamaRange]) -> None:
    head, tail = pair
    p = _prompts(tail)[0]
    outs = head.forward_many([
        Chunk(0, 0, tokens=p[:3]),
        Chunk(1, 5, tokens=p[:3]),  # this session holds nothing at position 5
        Chunk(2, 0, tokens=np.asarray([1, 2, 10**7], np.int32)),  # token id out of range
        Chunk(3, 0, tokens=p[:3]),
    ])
    assert isinstance(outs[1], CacheMissError)
    assert isinstance(outs[2], ShapeError)
    a, b = outs[0], outs[3]
    assert not isinstance(a, Exception)
    assert not isinstance(b, Exception)
    np.testing.assert_array_equal(a.residual, b.residual)  # same tokens, same rows
    assert head.next_pos(1) == 0
    assert head.next_pos(2) == 0
    assert head.next_pos(0) == 3
    with pytest.raises(ExecutorError):
        head.forward_many([Chunk(0, 3, tokens=p[:1]), Chunk(0, 3, tokens=p[:2])])
    for s in range(4):
        head.release(s)


async def test_concurrent_forwards_coalesce_into_batches(model: Path) -> None:
    ex = RangeExecutor(ensure_range(model, 0, CUT), ExecConfig(max_sessions=8))
    try:
        slots = [ex.open_slot() for _ in range(8)]
        assert slots == list(range(8))  # lowest free first: runs of consecutive ids batch

        async def one(slot: int) -> None:
            for pos in range(4):
                await ex.forward(slot, pos, tokens=np.asarray([slot + 1], np.int32))

        async with trio_asyncio.open_loop():
            async with trio.open_nursery() as nursery:
                for s in slots:
                    nursery.start_soon(trio_asyncio.aio_as_trio(one), s)
            assert ex.steps_total == 32
            assert ex.batches_total < 32  # steps queued while the worker ran were batched
            for s in slots:
                await trio_asyncio.aio_as_trio(ex.release)(s)
        assert ex.free_slots == 8
    finally:
        ex.close()


def test_a_group_dispatches_when_whole_or_when_nothing_more_comes() -> None:
    assert settled(4, 4, 0, 0)  # the whole group is queued
    assert settled(8, 0, QUIET_ITERATIONS, 1)  # no bound: nothing new for a while
    assert not settled(3, 4, 0, 1)  # a fourth was queued an iteration ago: the rest may follow
    assert not settled(3, 4, QUIET_ITERATIONS - 1, 2)
    assert settled(3, 4, QUIET_ITERATIONS, 3)
    assert settled(1, 4, 0, MOST_WAIT_ITERATIONS)  # a group trickling in never holds the first step longer


def test_a_group_arriving_over_several_loop_iterations_runs_as_one_batch(model: Path) -> None:
    """Each session's frame reaches the executor from its own coroutine: a group whose steps come one
    loop iteration apart (as the rows of one link message do) still runs as one llama_decode, on a
    plain asyncio loop as a node's data plane is (where a decode step runs inline)."""
    ex = RangeExecutor(ensure_range(model, 0, CUT), ExecConfig(max_sessions=4, n_threads=1))
    try:
        slots = [ex.open_slot() for _ in range(4)]

        async def one(slot: int, pos: int) -> None:
            for _ in range(slot):  # session k reaches the executor k iterations after the first
                await asyncio.sleep(0)
            await ex.forward(slot, pos, tokens=np.asarray([slot + 1], np.int32))

        async def rounds() -> None:
            for pos in range(3):
                await asyncio.gather(*(one(s, pos) for s in slots))
            for s in slots:
                await ex.release(s)

        loop = asyncio.SelectorEventLoop()  # as transport/aiothread.py makes it (not trio-asyncio's)
        try:
            loop.run_until_complete(rounds())
        finally:
            loop.close()
        assert ex.steps_total == 12
        assert ex.batches_total == 3  # one llama_decode a round, not one per arrival
    finally:
        ex.close()


def test_a_hop_before_others_computes_groups_of_consecutive_slots(model: Path) -> None:
    """Steps queued in the order 0, 2, 4, 6, 1, 3, 5, 7 at a hop with one hop after it run as the groups
    {0..3} and {4..7} (one pass over the weights each), not as {0, 2, 4, 6} (four passes in llama.cpp)."""
    ex = RangeExecutor(ensure_range(model, 0, CUT), ExecConfig(max_sessions=8, n_threads=1))
    batches: list[list[int]] = []
    run = ex._range.forward_many

    def recorded(chunks: list[Chunk]) -> list[object]:
        batches.append(sorted(c.seq for c in chunks))
        return run(chunks)  # type: ignore[return-value]

    ex._range.forward_many = recorded  # type: ignore[method-assign]
    try:
        slots = [ex.open_slot() for _ in range(8)]

        async def step() -> None:
            order = [0, 2, 4, 6, 1, 3, 5, 7]
            await asyncio.gather(*(ex.forward(s, 0, tokens=np.asarray([s + 1], np.int32), groups=2) for s in order))
            for s in slots:
                await ex.release(s)

        loop = asyncio.SelectorEventLoop()
        try:
            loop.run_until_complete(step())
        finally:
            loop.close()
        assert sorted(batches) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        ex.close()


def _moe_pair(model: Path, tmp_path: Path) -> tuple[LlamaRange, LlamaRange]:
    from tests.tiny import make

    path = make(tmp_path / "moe.gguf", "qwen3moe", tokenizer_from=model)
    cfg = ExecConfig(max_sessions=8, n_ctx_per_session=256)
    return LlamaRange(ensure_range(path, 0, 3), cfg), LlamaRange(ensure_range(path, 3, 6), cfg)


def test_moe_steps_batched_would_differ_so_moe_ranges_do_not_batch(model: Path, tiny_cache: Path,
                                                                   tmp_path: Path) -> None:
    """With experts, one llama_decode over several sessions' steps does not give each session its solo
    logits (ggml's mul_mat_id over several rows): shown here, it is why a MoE range never batches."""
    head, tail = _moe_pair(model, tmp_path)
    try:
        assert not head.batches_exactly
        assert not tail.batches_exactly
        prompts = _prompts(tail)[:4]
        solo = [_solo(head, tail, p) for p in prompts]
        pos, last = [], []
        for s, p in enumerate(prompts):
            res = head.forward(s, 0, tokens=p).residual
            out = tail.forward(s, 0, embd=res).logits
            assert out is not None
            last.append(int(np.argmax(out)))
            pos.append(len(p))
        hs = head.forward_many([Chunk(s, pos[s], tokens=np.asarray([last[s]], np.int32)) for s in range(4)])
        ts = tail.forward_many([Chunk(s, pos[s], embd=h.residual) for s, h in enumerate(hs)
                                if not isinstance(h, Exception)])
        batched = [t.logits for t in ts if not isinstance(t, Exception)]
        assert len(batched) == 4
        assert any(not np.array_equal(b, sol[1][1]) for b, sol in zip(batched, solo, strict=True))
    finally:
        head.close()
        tail.close()


async def test_moe_range_runs_one_session_per_decode(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """Concurrent sessions on a MoE range: every batch holds one step, and each session's logits
    equal its solo run."""
    from tests.tiny import make

    path = make(tmp_path / "moe.gguf", "qwen3moe", tokenizer_from=model)
    whole = LlamaRange(ensure_range(path, 0, 6), ExecConfig(max_sessions=1, n_ctx_per_session=256))
    assert whole.vocab is not None
    prompts = [np.asarray(whole.vocab.tokenize(p), dtype=np.int32) for p in PROMPTS[:4]]
    want = []
    for p in prompts:
        out = whole.forward(0, 0, tokens=p)
        toks = [int(np.argmax(out.logits))]
        for i in range(3):
            out = whole.forward(0, len(p) + i, tokens=np.asarray(toks[-1:], np.int32))
            toks.append(int(np.argmax(out.logits)))
        want.append(toks)
        whole.release(0)
    whole.close()
    ex = RangeExecutor(ensure_range(path, 0, 6), ExecConfig(max_sessions=4, n_ctx_per_session=256))
    got: dict[int, list[int]] = {}
    try:
        slots = [ex.open_slot() for _ in range(4)]

        async def one(slot: int) -> None:
            p = prompts[slot]
            t = await ex.forward(slot, 0, tokens=p)
            toks = [int(np.argmax(t.output.logits))]
            for i in range(3):
                t = await ex.forward(slot, len(p) + i, tokens=np.asarray(toks[-1:], np.int32))
                assert t.batch_size == 1
                toks.append(int(np.argmax(t.output.logits)))
            got[slot] = toks

        async with trio_asyncio.open_loop():
            async with trio.open_nursery() as nursery:
                for s in slots:
                    nursery.start_soon(trio_asyncio.aio_as_trio(one), s)
            assert ex.batches_total == ex.steps_total == 16
            for s in slots:
                await trio_asyncio.aio_as_trio(ex.release)(s)
    finally:
        ex.close()
    assert [got[s] for s in range(4)] == want
