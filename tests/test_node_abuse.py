"""What one party can make a node do is bounded (session/admission.py; docs/security.md), on real nodes.

* opens per initiator per minute (``--max-opens-per-minute``): over it, RESOURCE_EXHAUSTED naming the
  flag; another initiator is not affected, and opens forged in an initiator's name spend nothing of its;
* detached sessions at once (``--max-detached``): beyond, the oldest is freed;
* a stream that keeps sending steps beyond its credits is cut (FLOW_CONTROL_VIOLATION, terminal), and
  the node goes on serving.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import numpy as np
import trio

from meshnode.identity import NodeIdentity
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.session.admission import Recent, over_detached, overrun, room, supersedes
from meshnode.transport.client import open_channel
from meshnode.wire.schema import SCHEMA_VERSION
from tests.conftest import aio, open_frame, step_frame


def test_the_decisions():
    at = {"a": 3.0, "b": 1.0, "c": 2.0}
    assert room(at) == "b"
    assert room({}) is None
    assert over_detached(at, 3) == ["b"]  # one more makes four: the oldest goes
    assert over_detached(at, 2) == ["b", "c"]
    assert over_detached(at, 4) == []
    assert (overrun(8, 8), overrun(9, 8)) == (False, True)
    assert supersedes("i", 1, "i", 2)
    assert not supersedes("i", 2, "i", 2)  # the same epoch: not a later route
    assert not supersedes("i", 1, "stranger", 5)  # only the session's own initiator
    r = Recent(3)
    for k in "abcd":
        r.add(k)
    assert ("a" in r, "d" in r, len(r)) == (False, True, 3)


async def _open(stub: Any, cap: pb.Capability, ident: NodeIdentity, *, forge: bool = False,
                keep: bool = False) -> tuple[pb.SessionReply, Any]:
    sid = str(uuid.uuid4())
    frame = open_frame(sid, cap, ident)
    if forge:
        sig = bytearray(frame.open.signed_open.signature)
        sig[0] ^= 1
        frame.open.signed_open.signature = bytes(sig)
    call = stub.Session()
    await call.write(frame)
    reply = await call.read()
    if reply.HasField("accepted") and not keep:
        await call.write(pb.SessionFrame(route_session_id=sid, route_epoch=1, release=pb.ReleaseSignal()))
        assert (await call.read()).released
    if not keep:
        call.cancel()
    return reply, call


def _code(reply: pb.SessionReply) -> str:
    return "accepted" if reply.HasField("accepted") else pb.ErrorCode.Name(reply.error.code)


async def test_opens_per_initiator_are_bounded(node_factory):
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=("--max-opens-per-minute", "6")))
    a, b = NodeIdentity.generate(), NodeIdentity.generate()

    async def go() -> dict[str, Any]:
        async with await open_channel(tail.endpoint) as ch:
            stub = pb_grpc.NodeStub(ch)
            cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
            forged = [_code((await _open(stub, cap, a, forge=True))[0]) for _ in range(6)]
            mine = [(await _open(stub, cap, a))[0] for _ in range(7)]
            other = (await _open(stub, cap, b))[0]
            return {"forged": forged, "mine": mine, "other": other}

    seen = await aio(go)
    assert seen["forged"] == ["OPEN_FORGED"] * 6  # refused before they could spend a's opens
    assert [_code(r) for r in seen["mine"]] == ["accepted"] * 6 + ["RESOURCE_EXHAUSTED"]
    assert "--max-opens-per-minute" in seen["mine"][-1].error.message
    assert a.node_id in seen["mine"][-1].error.message
    assert _code(seen["other"]) == "accepted"


async def test_detached_sessions_are_bounded(node_factory):
    tail = await trio.to_thread.run_sync(
        lambda: node_factory("15:30", extra=("--max-sessions", "4", "--max-detached", "2")))

    async def go() -> dict[str, Any]:
        async with await open_channel(tail.endpoint) as ch:
            stub = pb_grpc.NodeStub(ch)
            cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
            seen: list[tuple[int, int]] = []
            for want in ((1, 1), (2, 2), (2, 2)):  # three sessions whose streams break without a release
                reply, call = await _open(stub, cap, NodeIdentity.generate(), keep=True)
                assert reply.HasField("accepted")
                call.cancel()
                for _ in range(200):  # the node notices the broken stream a moment later
                    h = await stub.Health(pb.HealthRequest())
                    if (h.detached_sessions, h.live_sessions) == want:
                        break
                    await asyncio.sleep(0.05)
                seen.append((h.detached_sessions, h.live_sessions))
            h = await stub.Health(pb.HealthRequest())
            fresh = (await _open(stub, cap, NodeIdentity.generate()))[0]
            return {"seen": seen, "health": h, "fresh": fresh}

    out = await aio(go)
    # (detached, slots in use): the third detach freed the oldest, and its KV slot
    assert out["seen"] == [(1, 1), (2, 2), (2, 2)]
    assert out["health"].detached_sessions == 2
    assert out["health"].live_sessions == 2  # the freed one gave its KV slot back
    assert _code(out["fresh"]) == "accepted"


async def test_a_stream_beyond_its_credits_is_cut_and_the_node_serves_on(node_factory):
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30"))
    x = np.random.default_rng(3).standard_normal((512, 576)).astype(np.float32)

    async def go() -> dict[str, Any]:
        async with await open_channel(tail.endpoint) as ch:
            stub = pb_grpc.NodeStub(ch)
            cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
            sid = str(uuid.uuid4())
            frame = open_frame(sid, cap, NodeIdentity.generate())
            frame.open.limits.credits = 1
            call = stub.Session()
            await call.write(frame)
            assert (await call.read()).accepted.limits.credits == 1
            # a 512-row prefill holds the one credit while twenty more steps pour in
            await call.write(step_frame(sid, 1, x, 0))
            for i in range(20):
                await call.write(step_frame(sid, 2 + i, x[:1], 512))
            replies = []
            while True:
                r = await call.read()
                if r is grpc.aio.EOF:
                    break
                replies.append(r)
                if r.HasField("error") and r.error.terminal:
                    break
            call.cancel()
            again = stub.Session()  # the node serves on: a new session, a step, an answer
            sid2 = str(uuid.uuid4())
            await again.write(open_frame(sid2, cap, NodeIdentity.generate()))
            assert (await again.read()).HasField("accepted")
            await again.write(step_frame(sid2, 1, x[:3], 0))
            after = await again.read()
            again.cancel()
            return {"replies": replies, "after": after}

    out = await aio(go)
    errs = [r.error for r in out["replies"] if r.HasField("error")]
    refused = [e for e in errs if not e.terminal]
    assert [pb.ErrorCode.Name(e.code) for e in refused] == ["FLOW_CONTROL_VIOLATION"] * 8
    cut = errs[-1]
    assert (pb.ErrorCode.Name(cut.code), cut.terminal) == ("FLOW_CONTROL_VIOLATION", True)
    assert "cut" in cut.message
    assert out["after"].HasField("result")
