"""How a node's llama.cpp threads are placed and wait (docs/performance.md, "Threads").

* libgomp in a ``meshnode serve`` process that decodes on several threads runs with meshnode's spin
  count, or with the user's;
* a llama_decode that starts an OpenMP team runs on the data plane's thread only under a wait policy:
  without one, two threads that each own a team make libgomp count more threads than cores and sleep
  at every barrier;
* thread defaults follow the CPUs the process may use (a cpuset or ``taskset``);
* a llama.cpp built without OpenMP gives each context a ggml pool of its own, whose threads sleep as soon
  as a graph is done, and its decode steps stay inline on the data plane's thread.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.executor import _bindings, openmp
from meshnode.executor.api import RangeExecutor
from meshnode.executor.config import ExecConfig, _cores, _cpus
from meshnode.gguf.slicer import ensure_range
from meshnode.runtime.launch import start_node
from meshnode.transport.aiothread import open_aio_thread


def test_configure_sets_the_spin_for_a_multithreaded_decode_unless_the_user_did() -> None:
    env: dict[str, str] = {}
    assert openmp.configure(2, env) == str(openmp.SPIN_ROUNDS)
    assert env == {"GOMP_SPINCOUNT": str(openmp.SPIN_ROUNDS), "OMP_WAIT_POLICY": "active"}
    assert openmp.teams_keep_their_spin(env)
    mine = {"GOMP_SPINCOUNT": "250", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp.configure(2, mine) == "250"
    assert mine == {"GOMP_SPINCOUNT": "250", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp.teams_keep_their_spin(mine)  # passive: nothing spins, nothing to cut
    single: dict[str, str] = {}
    assert openmp.configure(1, single) is None  # no team in decode: libgomp's default
    assert single == {}
    assert not openmp.teams_keep_their_spin(single)  # unset: a second team cuts every wait to 100 rounds
    assert not openmp.teams_keep_their_spin({"OMP_WAIT_POLICY": "sometimes"})


def test_thread_defaults_follow_the_cpus_this_process_may_use() -> None:
    assert 1 <= _cores() <= _cpus() == len(os.sched_getaffinity(0))
    cfg = ExecConfig()
    assert (cfg.n_threads, cfg.n_threads_solo, cfg.n_threads_batch) == (max(_cores() // 2, 1), _cores(), _cpus())
    code = ("from meshnode.executor.config import ExecConfig as E; c = E(); "
            "print(c.n_threads, c.n_threads_solo, c.n_threads_batch)")
    out = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1", "1"]  # one CPU: one thread each, not os.cpu_count()


def test_threads_from_the_command_line_set_every_decode_step() -> None:
    from meshnode.cli.flags import exec_config
    from meshnode.cli.main import build_parser

    ns = build_parser().parse_args(["serve", "--model", "m.gguf", "--layers", "0:15", "--threads", "3"])
    cfg = exec_config(ns)
    assert (cfg.n_threads, cfg.n_threads_solo) == (3, 3)  # the user's word, alone or with company
    cfg = exec_config(build_parser().parse_args(["serve", "--model", "m.gguf", "--layers", "0:15"]))
    assert (cfg.n_threads, cfg.n_threads_solo) == (ExecConfig().n_threads, _cores())


@pytest.mark.skipif(not _bindings.openmp(), reason="this llama.cpp was built without OpenMP: no libgomp to set")
@pytest.mark.parametrize("spin", [None, "2500"])
def test_a_multithreaded_node_loads_llama_cpp_with_its_spin(model: Path, spin: str | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")  # libgomp prints its settings when it loads
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if spin is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", spin)
    node = start_node(model, "15:30", extra=["--ctx-size", "256", "--max-sessions", "1", "--threads", "2"])
    try:
        node.proc.terminate()
        node.proc.wait(30)
        err = node.stderr()
    finally:
        node.stop()
    want = spin or str(openmp.SPIN_ROUNDS)
    assert f"GOMP_SPINCOUNT = '{want}'" in err, err[-2000:]
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in err, err[-2000:]  # a second team keeps that spin (openmp.py)


PROMPT = np.asarray([1, 504, 3575, 282], np.int32)


async def _step(ex: RangeExecutor, slot: int, pos: int) -> None:
    """One decode step, once the worker is done with the last one (else it would queue behind it)."""
    while ex._ctx.locked():  # noqa: ASYNC110 (a lock the worker thread holds)
        await asyncio.sleep(0)
    await ex.forward(slot, pos, tokens=np.asarray([314], np.int32))


async def _on_data_plane(ex: RangeExecutor, body: Any) -> None:
    """Run ``body`` on an asyncio thread named as a node's data plane, then close the executor."""
    try:
        async with open_aio_thread(name="dataplane") as aio:
            await aio.run(body)
    finally:
        ex.close()


@pytest.mark.parametrize("policy", [None, "active"])
@pytest.mark.parametrize("threads", [1, 2])
async def test_multithreaded_decode_leaves_the_data_plane_only_where_a_second_team_would_sleep(
        model: Path, threads: int, policy: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps run on the data plane's thread (two wake-ups fewer a step), prompt chunks on the worker.
    A step on several threads of an OpenMP build makes a second team there: it does so where the worker can
    give its team back when idle, or under a wait policy (openmp.py), else it joins the prompt chunks on the
    worker, one team in the process."""
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    ex = RangeExecutor(ensure_range(model, 0, 12), ExecConfig(n_ctx_per_session=256, max_sessions=1,
                                                              n_threads=threads, n_threads_solo=threads,
                                                              n_threads_batch=2))
    ran: list[tuple[str, int]] = []  # (thread, rows) of every llama_decode
    real = ex._range.forward_many

    def spy(chunks: list[Any]) -> Any:
        ran.append((threading.current_thread().name, sum(ex._rows(c) for c in chunks)))
        return real(chunks)

    ex._range.forward_many = spy  # type: ignore[method-assign]

    async def session() -> None:
        slot = ex.open_slot()
        await ex.forward(slot, 0, tokens=PROMPT)  # a prompt chunk
        for pos in range(4, 8):
            await _step(ex, slot, pos)

    await _on_data_plane(ex, session)
    decode = {name for name, rows in ran if rows == 1}
    prompt = {name for name, rows in ran if rows > 1}
    assert len(ran) == 5
    assert len(prompt) == 1
    assert len(decode) == 1
    if threads == 1 or ex._range.own_pool or policy is not None or openmp.can_release_teams():
        # single-threaded decode starts no team, a context with a ggml pool of its own (no OpenMP) wakes
        # that pool from any thread, the worker gives its team back when it goes idle (so the data plane's
        # is the only one while the session decodes), and under a wait policy a second team spins as the
        # first: it stays inline on the data plane's thread
        assert decode == {"dataplane"}
        assert prompt != decode
    else:  # decode starts a team: it runs where prompt chunks run, the executor's one worker thread
        assert decode == prompt
        assert "dataplane" not in decode


def _team(name: str) -> int:
    """Threads of this process named ``name`` (libgomp's team threads take their master's name)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == name
        except FileNotFoundError:  # ended meanwhile
            continue
    return count


async def test_the_worker_gives_its_openmp_team_back_when_idle_and_the_text_is_unchanged(model: Path) -> None:
    """A prompt chunk on two threads starts a team on the worker; once the worker is idle that team is
    gone (its thread ended), so the data plane's team is the process's only one while a session decodes
    and libgomp keeps its full spin (openmp.py). The next prompt chunk starts a team again and computes
    exactly what it did: the residuals of the same steps are bit-identical."""
    ex = RangeExecutor(ensure_range(model, 0, 12), ExecConfig(n_ctx_per_session=256, max_sessions=1,
                                                              n_threads=2, n_threads_solo=2, n_threads_batch=2))
    if ex._range.own_pool or not openmp.can_release_teams():
        ex.close()
        pytest.skip("this llama.cpp runs no OpenMP teams (a ggml pool of its own)")
    seen: list[int] = []
    outs: list[list[np.ndarray]] = []
    real = ex._range.forward_many

    def spy(chunks: list[Any]) -> Any:
        if threading.current_thread().name.startswith("llama"):
            seen.append(_team(openmp.WORKER_NAME))  # the worker and its team, before this chunk
        return real(chunks)

    ex._range.forward_many = spy  # type: ignore[method-assign]

    async def session() -> None:
        for _ in range(2):
            slot = ex.open_slot()
            got = [(await ex.forward(slot, 0, tokens=PROMPT)).output.residual]
            for pos in range(4, 7):
                while ex._ctx.locked():  # noqa: ASYNC110 (the worker's; a step then runs inline)
                    await asyncio.sleep(0)
                got.append((await ex.forward(slot, pos, tokens=np.asarray([314 + pos], np.int32))).output.residual)
            await ex.release(slot)
            outs.append(got)
            idle = _team(openmp.WORKER_NAME)
            assert idle == 1, f"{idle} worker threads once the worker is idle: its team was kept"

    await _on_data_plane(ex, session)
    assert seen  # the prompt chunks ran on the worker
    assert all(n == 1 for n in seen), seen  # each started from a worker without a team
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a is not None
        assert b is not None
        assert np.array_equal(a, b)


def test_a_context_with_a_ggml_pool_of_its_own_decodes_exactly_as_without(model: Path) -> None:
    """A llama.cpp built without OpenMP gives each context a ggml pool it keeps (``own_pool``; an OpenMP
    build runs its team instead). The binding is exercised on whichever build is installed: a pool attached
    by hand must leave every logit unchanged, and the pool is stopped before its context is freed."""
    from meshnode.executor._llama import LlamaRange

    art = ensure_range(model, 0, 30)
    cfg = ExecConfig(n_threads=2, n_threads_batch=2, max_sessions=1)
    plain, pooled = LlamaRange(art, cfg), LlamaRange(art, cfg)
    try:
        assert plain.own_pool is (not _bindings.openmp())
        pool = _bindings.attach_threadpool(pooled._ctx, 2, 0)
        try:
            toks = np.array([504, 3575, 282, 4649, 314], dtype=np.int32)
            pos = 0
            for _ in range(4):
                a, b = plain.forward(0, pos, tokens=toks).logits, pooled.forward(0, pos, tokens=toks).logits
                assert a is not None
                assert b is not None
                assert np.array_equal(a, b)
                pos += len(toks)
                toks = np.array([int(np.argmax(a))], dtype=np.int32)
        finally:
            _bindings.free_threadpool(pooled._ctx, pool)
    finally:
        plain.close()
        pooled.close()


async def test_one_live_session_decodes_on_every_core_and_several_on_the_decode_threads(model: Path) -> None:
    """One session's hops take turns, so its steps get ``n_threads_solo`` while those have measured
    faster; while two sessions are live their hops compute at once and the steps get ``n_threads``. A step
    on several threads of an OpenMP build leaves the data plane's thread for the executor's worker unless
    a wait policy keeps libgomp's spin with a second team."""
    ex = RangeExecutor(ensure_range(model, 0, 12), ExecConfig(n_ctx_per_session=256, max_sessions=2, n_threads=1,
                                                              n_threads_solo=2, n_threads_batch=2))
    ex._solo.mean = {2: 0.0, 1: 1.0}  # two threads have been the faster (by far)
    seen: list[tuple[int, int, str]] = []  # (live sessions, threads, thread) of every batch of decode steps
    real = ex._range.forward_many

    def spy(chunks: list[Any]) -> Any:
        if all(ex._rows(c) == 1 for c in chunks):
            seen.append((ex.live_slots, ex._range.decode_threads, threading.current_thread().name))
        return real(chunks)

    ex._range.forward_many = spy  # type: ignore[method-assign]

    async def sessions() -> None:
        a = ex.open_slot()
        await ex.forward(a, 0, tokens=PROMPT)
        await _step(ex, a, 4)
        b = ex.open_slot()
        await ex.forward(b, 0, tokens=PROMPT)
        await _step(ex, a, 5)
        await _step(ex, b, 4)
        await ex.release(b)
        await _step(ex, a, 6)

    await _on_data_plane(ex, sessions)
    assert [(live, threads) for live, threads, _ in seen] == [(1, 2), (2, 1), (2, 1), (1, 2)]
    for _, threads, name in seen:
        assert (name == "dataplane") is (threads == 1 or ex._inline_teams)


def test_a_lone_sessions_threads_follow_what_its_steps_measure() -> None:
    """Each count measured once (the most threads first), then the faster one, with a probe of the other
    PROBE_EVERY steps after the last, the interval doubling with each probe the most threads win, up to
    PROBE_RARELY; when the host starts stealing the team's partner (its steps slow down eight times), the
    chooser moves to one thread at once, and back within a probe period after the steal stops."""
    from meshnode.executor.threads import PROBE_EVERY, PROBE_RARELY, ThreadChooser

    c = ThreadChooser((1, 2))
    assert c.pick() == 2
    c.record(2, 0.003)
    assert c.pick() == 1
    c.record(1, 0.005)
    quiet = {2: 0.003, 1: 0.005}

    def run(steps: int, times: dict[int, float]) -> list[int]:
        picks = []
        for _ in range(steps):
            n = c.pick()
            assert c.pick() == n  # asking again changes nothing
            picks.append(n)
            c.record(n, times[n])
        return picks

    picks = run(4 * PROBE_RARELY, quiet)
    probes = [i for i, n in enumerate(picks) if n == 1]
    assert probes[0] == PROBE_EVERY - 1  # the first a period in
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps)  # backing off
    assert gaps[0] == 2 * PROBE_EVERY
    assert gaps[-1] == PROBE_RARELY
    assert len(probes) < 4 * PROBE_RARELY // PROBE_EVERY // 4  # far fewer than one a PROBE_EVERY
    picks = run(2 * PROBE_EVERY, {2: 0.025, 1: 0.005})
    assert picks.index(1) < 4  # the favourite slowed: probed at once, and it lost
    assert picks[-PROBE_EVERY:].count(2) <= 1  # on one thread, probing two now and then
    picks = run(3 * PROBE_EVERY, quiet)
    assert picks.index(2) <= PROBE_EVERY  # a stealing host's favourite keeps probing every PROBE_EVERY
    assert picks[-2 * PROBE_EVERY:].count(2) >= 2 * PROBE_EVERY - 1  # back on two threads
    assert ThreadChooser((2, 2)).options == (2,)  # --threads N: nothing to choose


def test_fewer_threads_take_over_only_when_clearly_faster() -> None:
    """A probe of one thread that measures a little faster than two (a lull in the host's noise) leaves
    the session on two threads; one that measures MARGIN faster moves it."""
    from meshnode.executor.threads import MARGIN, PROBE_EVERY, ThreadChooser

    c = ThreadChooser((1, 2))
    c.record(c.pick(), 0.010)
    c.record(c.pick(), 0.010 / (1 + MARGIN / 2))  # one thread, a little faster
    assert c.pick() == 2
    for _ in range(PROBE_EVERY - 1):
        c.record(c.pick(), 0.010)
    assert c.pick() == 1  # the probe
    c.record(1, 0.010 / (1 + 2 * MARGIN))  # clearly faster
    assert c.pick() == 1


@pytest.mark.parametrize(("var", "value", "message"), [
    *(("MESHNODE_POLL", v, "MESHNODE_POLL must be a whole number from 0 to 100") for v in ("fast", "-1", "101", "")),
    *(("MESHNODE_LINGER", v, "MESHNODE_LINGER must be seconds from 0") for v in ("soon", "-1", "11", "nan")),
])
def test_a_malformed_executor_variable_is_a_typed_error_at_serve(var: str, value: str, message: str,
                                                                 tmp_path: Path) -> None:
    env = {**os.environ, var: value, "XDG_STATE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "meshnode", "serve", "--model", str(tmp_path / "m.gguf"),
                          "--layers", "0:15", "--state-dir", str(tmp_path / "state")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
