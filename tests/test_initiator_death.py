"""The initiator dies mid-Generate: the head stops decoding for it and keeps serving others.

A running Generate posts each result to the stream's writer and goes on to the next token
(session/replies.py ``ReplyWriter``), so nothing on its path waits for the initiator; when the
initiator's stream is gone, grpc cancels the stream's handler (or, first, a post finds the send
failed and raises) and the Generate ends. The session is detached (its KV kept for a resume, as
after any broken stream), never left decoding for nobody, and the route's next session is exact.
"""

from __future__ import annotations

import json
import signal
import sys

import trio

from meshnode.proto import node_pb2 as pb
from meshnode.transport.client import health
from tests.conftest import PROMPT, aio, cli, initiator


async def _steps_settle(endpoint: str, timeout: float) -> pb.HealthReply:
    """Health once ``steps_total`` stopped moving (polled every 0.5 s), bounded by ``timeout``."""
    with trio.fail_after(timeout):
        last = -1
        while True:
            h: pb.HealthReply = await aio(health, endpoint, 5.0)
            if h.steps_total == last:
                return h
            last = h.steps_total
            await trio.sleep(0.5)


async def test_a_killed_initiator_stops_its_generate_and_the_route_serves_on(route2, reference) -> None:
    head, tail = route2
    peers = [a for n in route2 for a in ("--peer", n.endpoint)]
    before = await aio(health, head.endpoint, 5.0)
    cmd = [sys.executable, "-m", "meshnode", "generate", *peers, "--prompt", PROMPT, "--max-tokens", "500",
           "--temperature", "0", "--stream", "--json"]
    seen = trio.Event()
    lines: list[bytes] = []

    def on_line(line: bytes) -> None:
        lines.append(line)
        if len(lines) >= 8:  # decoding for real
            seen.set()

    async with initiator(cmd, timeout=120, on_line=on_line) as run:
        with trio.fail_after(60):
            await seen.wait()
        run.proc.send_signal(signal.SIGKILL)
    h = await _steps_settle(head.endpoint, 30)
    decoded = h.steps_total - before.steps_total
    # it stopped well short of the 500 tokens asked (a few in flight at the kill at most)
    assert len(lines) <= decoded < 400, (len(lines), decoded)
    # detached, not freed: a resume may still come (other tests' sessions on this shared route may be
    # in their grace period too, so this is "at least ours")
    assert h.detached_sessions >= 1
    t = await _steps_settle(tail.endpoint, 30)
    assert t.detached_sessions >= 1  # the head hung up on the tail: it keeps the KV for a resume too

    out = await trio.to_thread.run_sync(lambda: cli("generate", *peers, "--prompt", PROMPT, "--max-tokens", "32",
                                                    "--temperature", "0", "--json"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokens"] == reference.tokens


async def test_ctrl_c_on_generate_releases_the_route_at_once(node_factory) -> None:
    """SIGINT is the user giving up: the initiator releases its session on every hop (out of band,
    signed) before it exits 130, so no hop keeps the KV for the detach grace (30 s)."""
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ("0:15", "15:30")]
    peers = [a for n in nodes for a in ("--peer", n.endpoint)]
    # the generate process gets SIGINT's default disposition whatever this one inherited (a test run started
    # in the background by a shell without job control ignores SIGINT, and so would every child it starts)
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, '-m', 'meshnode', *sys.argv[1:]])")
    cmd = [sys.executable, "-c", reset, "generate", *peers, "--prompt", "Count: 1, 2, 3, 4,",
           "--max-tokens", "2000", "--temperature", "0", "--stream", "--json"]
    seen = trio.Event()
    lines: list[bytes] = []

    def on_line(line: bytes) -> None:
        lines.append(line)
        if len(lines) >= 8:
            seen.set()

    async with initiator(cmd, timeout=120, on_line=on_line) as run:
        with trio.fail_after(60):
            await seen.wait()
        before = run.proc.poll()  # None: still generating when interrupted (the case under test)
        run.proc.send_signal(signal.SIGINT)
    assert run.proc.returncode == 130, (f"exit {run.proc.returncode}; it had exited before the SIGINT: "
                                        f"{before is not None}; {len(lines)} lines seen", run.text()[-2000:])
    with trio.fail_after(5):  # far below the detach grace: released, not detached
        for n in nodes:
            # a remote count: polling over gRPC is the only way to see it
            while (h := await aio(health, n.endpoint, 5.0)).live_sessions:  # noqa: ASYNC110
                await trio.sleep(0.1)
            assert (h.detached_sessions, h.free_sessions) == (0, 4)
