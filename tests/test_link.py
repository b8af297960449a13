"""Links: several sessions' frames from one hop to the next travel in one message (transport/link.py).

Real nodes (separate processes, TLS) and a real initiator: eight sessions decode at once through a
two-hop route. The tail's own metrics say how many link messages came in and how many session frames
they carried; each session's text equals the whole model's. A head started with ``--no-link`` sends
none. A tail killed under eight live sessions breaks the link: every session fails over to a spare on
its own and still equals the whole model.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
import uuid

import grpc
import trio

from meshnode.identity import NodeIdentity
from meshnode.proto import node_pb2 as pb
from meshnode.session.initiator import GenerateConfig, generate
from meshnode.transport.client import health
from meshnode.transport.link import MAX_ENTRIES, MAX_LINK_STREAMS, MAX_QUEUED
from tests.conftest import aio, llama_reference
from tests.test_fuzz import _connect, build_open

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of",
           "1, 2, 3, 4,", "Once upon a time", "The quick brown fox", "import numpy as", "Water boils at"]
N_TOKENS = 12
N_CTX = 512


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    rows = re.finditer(r"^(\S+) (\S+)$", text, re.M)
    return {m.group(1): float(m.group(2)) for m in rows if not m.group(1).startswith("#")}


def _link_in(url: str) -> tuple[float, float]:
    m = _scrape(url)
    return (m.get('meshnode_link_messages_total{direction="in"}', 0.0),
            m.get('meshnode_link_entries_total{direction="in"}', 0.0))


async def _all_at_once(peers: list[str], spares: list[str] | None = None, kill: object = None,
                       prompts: list[str] = PROMPTS, n_tokens: int = N_TOKENS) -> list[object]:
    ident = NodeIdentity.generate()
    tasks = [asyncio.ensure_future(generate(peers, GenerateConfig(prompt=p, max_tokens=n_tokens), ident,
                                            spares=spares or []))
             for p in prompts]
    if kill is not None:
        await asyncio.sleep(0)
        while not any(t.done() for t in tasks):
            h = await asyncio.to_thread(lambda: _scrape(kill[1]))  # type: ignore[index]
            if h.get('meshnode_tokens_total{kind="decode"}', 0) >= 16:  # every session decoding
                break
            await asyncio.sleep(0.02)
        kill[0].proc.kill()  # type: ignore[index]
    return list(await asyncio.gather(*tasks))


async def _references(model: object) -> list[list[int]]:
    return [await trio.to_thread.run_sync(lambda p=p: llama_reference(model, p, N_TOKENS, N_CTX).tokens)
            for p in PROMPTS]


def _metrics_url(node: object) -> str:
    return str(json.loads((node.state_dir / "node.json").read_text())["metrics"])  # type: ignore[attr-defined]


async def test_eight_sessions_frames_share_link_messages_and_each_text_is_exact(model, node_factory):
    refs = await _references(model)
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=("--max-sessions", "8")))
    tail = await trio.to_thread.run_sync(
        lambda: node_factory("15:30", extra=("--max-sessions", "8", "--metrics", "127.0.0.1:0")))
    url = _metrics_url(tail)
    with trio.fail_after(300):
        results = await aio(_all_at_once, [head.endpoint, tail.endpoint])
    assert [r.tokens for r in results] == refs
    messages, entries = await trio.to_thread.run_sync(_link_in, url)
    # every session's frames reached the tail over the link: its open, prefill, steps and release
    assert entries >= len(PROMPTS) * (N_TOKENS + 1)
    assert messages < entries, (messages, entries)  # some messages carried several sessions' frames


async def test_a_head_with_no_link_sends_each_session_on_a_stream_of_its_own(model, node_factory):
    refs = await _references(model)
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=("--max-sessions", "8", "--no-link")))
    tail = await trio.to_thread.run_sync(
        lambda: node_factory("15:30", extra=("--max-sessions", "8", "--metrics", "127.0.0.1:0")))
    with trio.fail_after(300):
        results = await aio(_all_at_once, [head.endpoint, tail.endpoint])
    assert [r.tokens for r in results] == refs
    assert await trio.to_thread.run_sync(_link_in, _metrics_url(tail)) == (0.0, 0.0)


async def test_a_tail_killed_under_eight_sessions_breaks_the_link_and_each_fails_over(model, node_factory):
    # a count never ends by itself before its limit: every session is still decoding when the tail dies
    count, n = "1, 2, 3, 4,", 40
    ref = await trio.to_thread.run_sync(lambda: llama_reference(model, count, n, N_CTX).tokens)
    assert len(ref) == n
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=("--max-sessions", "8")))
    tail = await trio.to_thread.run_sync(
        lambda: node_factory("15:30", extra=("--max-sessions", "8", "--metrics", "127.0.0.1:0")))
    spare = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=("--max-sessions", "8")))
    with trio.fail_after(300):
        results = await aio(_all_at_once, [head.endpoint, tail.endpoint], [spare.endpoint],
                            (tail, _metrics_url(tail)), [count] * 8, n)
    assert [r.tokens for r in results] == [ref] * 8
    for r in results:
        assert [f["hop"] for f in r.failovers] == [tail.endpoint], r.failovers
        assert r.route == [head.endpoint, spare.endpoint]


async def _to_end(call: object) -> list[pb.LinkReply]:
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        out.append(r)
    return out


async def _bounds(proc: object) -> tuple[list[pb.LinkReply], list[pb.LinkReply], list[pb.LinkReply]]:
    """Two Link calls to a one-slot tail: (1) a session on stream 1 holds the slot, 1,023 more opens wait
    for it, and one stream more is refused by the link's bound; (2) a message of 1,025 entries."""
    node = await _connect(proc)  # type: ignore[arg-type]
    try:
        first, _ = build_open(str(uuid.uuid4()), [node], NodeIdentity.generate())
        call = node.stub.Link()
        await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=1, frame=first)]))
        got = [await call.read()]  # stream 1 accepted: the only slot is taken
        waiting = [pb.LinkEntry(stream=n, frame=pb.SessionFrame(route_session_id=f"w{n}", open=pb.SessionOpen()))
                   for n in range(2, MAX_LINK_STREAMS + 1)]
        await call.write(pb.LinkFrame(entries=waiting))  # each waits (admission_wait) for a slot: still live
        await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=MAX_LINK_STREAMS + 1, frame=first)]))
        await call.done_writing()
        got += await _to_end(call)
        call = node.stub.Link()
        await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=1, frame=first)]))
        await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=n) for n in range(MAX_ENTRIES + 1)]))
        cut = await _to_end(call)
        # a stream hung up in the message that started it (its task cancelled before it ran) still ends
        call = node.stub.Link()
        step = pb.SessionFrame(route_session_id="x", step=pb.Step(step_id=1, tokens=[1]))
        await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=7, frame=step), pb.LinkEntry(stream=7, close=True)]))
        await call.done_writing()
        return got, cut, await _to_end(call)
    finally:
        await node.channel.close()


async def test_a_link_bounds_its_streams_and_its_messages(node_factory):
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=("--max-sessions", "1")))
    with trio.fail_after(120):
        got, cut, hung_up = await aio(_bounds, tail)
    entries = [e for r in got for e in r.entries]
    assert entries[0].stream == 1
    assert entries[0].reply.HasField("accepted")
    extra = [e for e in entries if e.stream == MAX_LINK_STREAMS + 1]
    assert len(extra) == 1, extra
    assert extra[0].ended
    assert pb.ErrorCode.Name(extra[0].reply.error.code) == "RESOURCE_EXHAUSTED"
    assert extra[0].reply.error.terminal
    # the waiting opens: refused for want of a slot, or hung up with the link (its half-close); each ended
    for n in range(2, MAX_LINK_STREAMS + 1):
        mine = [e for e in entries if e.stream == n]
        assert mine[-1].ended, mine
        assert all(pb.ErrorCode.Name(e.reply.error.code) == "RESOURCE_EXHAUSTED" for e in mine[:-1]), mine
    # a message over MAX_ENTRIES cuts the link: the session on it is hung up (detached, its KV kept)
    assert [e.stream for r in cut for e in r.entries if e.ended] == [1]
    assert [(e.stream, e.ended) for r in hung_up for e in r.entries] == [(7, True)]
    h = await aio(health, tail.endpoint, 10.0)
    assert h.serving
    assert h.live_sessions == h.detached_sessions


async def _flood(proc: object) -> tuple[list[pb.LinkReply], tuple[int, int], list[pb.LinkReply]]:
    """On a two-slot tail, sessions on streams 1 and 2; then MAX_QUEUED + 1 frames for stream 1 in one
    message (the link feeds a message's entries before any session reads). Returns the replies until
    stream 1 ended, the tail's (live, detached) sessions then, and the replies after the half-close."""
    node = await _connect(proc)  # type: ignore[arg-type]
    try:
        call = node.stub.Link()
        opens = [build_open(str(uuid.uuid4()), [node], NodeIdentity.generate())[0] for _ in range(2)]
        got = []
        for n, frame in enumerate(opens, 1):
            await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=n, frame=frame)]))
            got.append(await call.read())  # accepted
        step = pb.SessionFrame(route_session_id=opens[0].route_session_id, step=pb.Step(step_id=1, tokens=[1]))
        await call.write(pb.LinkFrame(entries=[pb.LinkEntry(stream=1, frame=step)] * (MAX_QUEUED + 1)))
        replies = 0  # without the bound, each of the frames gets its reply (EPOCH_STALE) and the stream goes on
        while not any(e.stream == 1 and e.ended for e in got[-1].entries) and replies <= MAX_QUEUED:
            got.append(await call.read())
            replies += sum(e.stream == 1 and not e.ended for e in got[-1].entries)
        h = await health(proc.endpoint, 10.0)  # type: ignore[attr-defined]
        await call.done_writing()
        return got, (h.live_sessions, h.detached_sessions), await _to_end(call)
    finally:
        await node.channel.close()


async def test_a_stream_that_lets_too_many_frames_wait_is_cut_and_the_others_go_on(node_factory):
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=("--max-sessions", "2")))
    with trio.fail_after(120):
        got, (live, detached), after = await aio(_flood, tail)
    assert [(e.stream, e.reply.HasField("accepted")) for r in got[:2] for e in r.entries] == [(1, True), (2, True)]
    assert [e.stream for r in got for e in r.entries if e.ended] == [1]  # stream 1 cut, unread
    assert len([e for r in got[2:] for e in r.entries if e.stream == 1]) < 8  # the frames it let wait never ran
    assert (live, detached) == (2, 1)  # stream 1's session detached (its KV kept), stream 2's lives on
    assert [e.stream for r in after for e in r.entries if e.ended] == [2]  # until the link's half-close
    h = await aio(health, tail.endpoint, 10.0)
    assert h.serving
