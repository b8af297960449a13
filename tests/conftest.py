"""Shared fixtures: the default model, the whole-model reference, node processes.

Node processes are real ``meshnode serve`` children on 127.0.0.1 port 0;
each is awaited until it prints ``listening on`` (no sleeps), and stopped at
the end of its fixture's scope.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

from meshnode.errors import typed_leaf
from meshnode.executor._bindings import silence_llama_logs
from meshnode.models import pull
from meshnode.runtime.launch import NodeProcess, local_route, start_node
from meshnode.transport.aiothread import AioThread, _log_loop_error, _serve_loop

PROMPT = "The three primary colors are"


@pytest.fixture(scope="session", autouse=True)
def own_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's own XDG_STATE_HOME: a node or initiator the tests start without
    --state-dir (and a default-state-dir test) never meets the user's own nodes and keys in
    ~/.local/state/meshnode. Set before any fixture starts a node (autouse fixtures of a scope
    come first); children inherit it. The model cache is the user's and is only read."""
    home = tmp_path_factory.mktemp("state-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(home))
        mp.delenv("STATE_DIRECTORY", raising=False)  # a test run from a systemd unit
        yield home


@pytest.fixture(scope="session")
def model() -> Path:
    silence_llama_logs()
    return pull()


@pytest.fixture(scope="module")
def tiny_cache(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Range artifacts of tiny models go to a temporary cache, not the user's.

    Depends on ``model`` so the default model is resolved (in the real cache)
    before the variable is changed; module-scoped so it is restored before
    other test modules run (``cache_dir()`` reads it at call time).
    """
    cache = tmp_path_factory.mktemp("meshnode-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHNODE_CACHE_DIR", str(cache))
        yield cache


@dataclass(frozen=True)
class Reference:
    prompt_tokens: list[int]
    tokens: list[int]
    #: the logits each token was sampled from (the last prompt token's, then each generated token's)
    logits: list[np.ndarray]


def llama_reference(model: Path, prompt: str, n: int, n_ctx: int = 512, *, via_generate: bool = True) -> Reference:
    """Greedy tokens of llama-cpp-python's ``Llama`` with its default context settings (``n_ctx``: its default).

    ``via_generate``: check them once more through ``Llama.generate`` (a second prefill of the prompt).
    """
    llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, verbose=False)
    try:
        toks = llm.tokenize(prompt.encode(), special=True)
        out: list[int] = []
        logits: list[np.ndarray] = []
        llm.eval(toks)
        while len(out) < n:
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
            tok = int(np.argmax(row))
            if llm.token_eos() == tok:
                break  # as in Llama.create_completion: the end-of-generation token is not part of the tokens
            out.append(tok)
            logits.append(row)
            llm.eval([tok])
        if via_generate:  # the same tokens through Llama's own sampling loop (greedy = temp 0)
            llm.reset()
            again: list[int] = []
            for t in llm.generate(toks, temp=0.0, repeat_penalty=1.0):
                if len(again) == len(out):
                    break
                again.append(t)
            assert again == out
        return Reference(toks, out, logits)
    finally:
        llm.close()


@pytest.fixture(scope="session")
def reference(model: Path) -> Reference:
    return llama_reference(model, PROMPT, 32)


@pytest.fixture(scope="session")
def route2(model: Path) -> Iterator[list[NodeProcess]]:
    with local_route(model, ["0:15", "15:30"]) as nodes:
        yield nodes


@pytest.fixture(scope="session")
def route3(model: Path) -> Iterator[list[NodeProcess]]:
    with local_route(model, ["0:7", "7:19", "19:30"]) as nodes:
        yield nodes


@pytest.fixture
def node_factory(model: Path) -> Iterator[Callable[..., NodeProcess]]:
    started: list[NodeProcess] = []

    def make(layers: str | None, *, source: Path | None = None, extra: tuple[str, ...] = (),
             command: str = "serve", cpus: Sequence[int] = (), prefix: Sequence[str] = ()) -> NodeProcess:
        n = start_node(source or model, layers, extra=extra, command=command, cpus=cpus, prefix=prefix)
        started.append(n)
        return n

    yield make
    for n in started:
        n.stop()


_AIO: list[AioThread] = []


def _tests_aio() -> AioThread:
    """One asyncio loop on a thread of its own for the whole test session, as a node has one for its life
    (meshnode/transport/aiothread.py). A loop per test would be closed while grpc still owes it completions
    (a secure channel's shutdown): grpc's poller then fails on the closed loop inside the next test's."""
    if not _AIO:
        loop = asyncio.SelectorEventLoop()
        loop.set_exception_handler(_log_loop_error)
        threading.Thread(target=_serve_loop, args=(loop,), name="tests-aio", daemon=True).start()
        _AIO.append(AioThread(loop))
    return _AIO[0]


async def aio(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run an asyncio coroutine function (the grpc.aio side) from a trio test, on the tests' asyncio thread."""
    try:
        return await _tests_aio().run(functools.partial(fn, *args, **kwargs))
    except BaseExceptionGroup as group:
        typed = typed_leaf(group)
        if typed is None:
            raise
        raise typed from group


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"test leaked threads: {leaked}"


def open_frame(sid: str, cap: Any, ident: Any = None, *, epoch: int = 1, now: int | None = None) -> Any:
    """A SessionOpen for a one-hop route to ``cap``'s node, signed by ``ident`` (fresh if None)."""
    import time

    from meshnode.identity import NodeIdentity
    from meshnode.identity.routeauth import HopPlan, sign_route
    from meshnode.proto import node_pb2 as pb
    from meshnode.wire.schema import SCHEMA_VERSION

    ident = ident or NodeIdentity.generate()
    plan = HopPlan(cap.node_id, cap.attestation.signer_public_key, cap.range.start, cap.range.end)
    (signed,) = sign_route(ident, session_id=sid, epoch=epoch, fingerprint=cap.model_fingerprint, hops=[plan],
                           now=int(time.time()) if now is None else now)
    return pb.SessionFrame(route_session_id=sid, route_epoch=epoch, open=pb.SessionOpen(
        schema_version=SCHEMA_VERSION, route_session_id=sid, route_epoch=epoch,
        model_fingerprint=cap.model_fingerprint, range=cap.range, numerics=cap.numerics, limits=cap.limits,
        signed_open=signed))


def step_frame(sid: str, step_id: int, x: np.ndarray, n_past: int, *, epoch: int = 1, work: str = "",
               sample: bool = False) -> Any:
    """A Step carrying residual rows ``x`` at positions ``n_past``.., expecting ``n_past`` cached."""
    from meshnode.proto import node_pb2 as pb
    from meshnode.wire.tensors import encode_bundle

    return pb.SessionFrame(route_session_id=sid, route_epoch=epoch, step=pb.Step(
        step_id=step_id, work_id=work, activation=encode_bundle(x, pos_start=n_past), sample=sample,
        cache=pb.CacheExpectation(n_past=n_past)))


@dataclass
class Initiator:
    """A ``meshnode generate`` child process and what it printed so far."""

    proc: Any  # trio.Process
    stdout: bytearray
    stderr: bytearray

    def text(self) -> str:
        return self.stderr.decode(errors="replace")


@asynccontextmanager
async def initiator(cmd: list[str], *, timeout: float,
                    on_line: Callable[[bytes], None] | None = None) -> AsyncIterator[Initiator]:
    """Run ``cmd`` while the body acts on the nodes; both pipes are read all along (``on_line`` sees
    each stdout line as it arrives). On leaving, waits for the process; killed if anything failed;
    all of it bounded by ``timeout``."""
    import subprocess

    import trio

    async def pump(stream: Any, into: bytearray, lines: Callable[[bytes], None] | None) -> None:
        start = 0
        while chunk := await stream.receive_some():
            into.extend(chunk)
            while lines is not None and (end := into.find(b"\n", start)) >= 0:
                lines(bytes(into[start:end]))
                start = end + 1

    with trio.fail_after(timeout):
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        run = Initiator(proc, bytearray(), bytearray())
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, proc.stdout, run.stdout, on_line)
                nursery.start_soon(pump, proc.stderr, run.stderr, None)
                yield run
                await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def cli(*args: str, timeout: float = 300) -> Any:
    """Run ``meshnode ARGS`` as a user would: a separate process; returns the CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "meshnode", *args], capture_output=True, text=True, timeout=timeout)


def until(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``pred`` until it is true (returned) or ``timeout`` seconds pass (AssertionError naming ``what``);
    for state only another process can show (no timing is asserted)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")
