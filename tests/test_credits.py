"""Flow-control credits on real nodes: negotiated as the strictest side, enforced both ways.

* steps in: a step beyond the credits is refused on arrival (FLOW_CONTROL_VIOLATION, not executed);
  once results return their credits, the same step is accepted;
* results out: a Generate pauses after ``credits`` unacknowledged results; a CreditGrant resumes it.
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np

from meshnode.identity import NodeIdentity
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.session.initiator import GenerateConfig, RouteSession, check_route
from meshnode.transport.client import health, open_channel
from meshnode.wire.schema import SCHEMA_VERSION
from tests.conftest import aio, open_frame, step_frame


async def _steps_beyond_credits(endpoint: str) -> dict[str, object]:
    seen: dict[str, object] = {}
    x = np.random.default_rng(5).standard_normal((258, 576)).astype(np.float32)
    async with await open_channel(endpoint) as ch:
        stub = pb_grpc.NodeStub(ch)
        cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
        sid = str(uuid.uuid4())
        frame = open_frame(sid, cap, NodeIdentity.generate())
        frame.open.limits.credits = 2  # stricter than the node's own 4: the strictest wins
        call = stub.Session()
        await call.write(frame)
        seen["limits"] = (await call.read()).accepted.limits
        # a long prefill chunk keeps the hop busy while the next two steps arrive
        for sid_step, rows, pos in ((1, x[:256], 0), (2, x[256:257], 256), (3, x[257:258], 257)):
            await call.write(step_frame(sid, sid_step, rows, pos))
        replies = [await call.read() for _ in range(3)]
        seen["errors"] = [(r.error.step_id, pb.ErrorCode.Name(r.error.code), r.error.terminal)
                          for r in replies if r.HasField("error")]
        seen["results"] = sorted(r.result.step_id for r in replies if r.HasField("result"))
        await call.write(step_frame(sid, 3, x[257:258], 257))  # results came back: credits are free again
        seen["retry"] = await call.read()
        await call.write(pb.SessionFrame(route_session_id=sid, route_epoch=1, release=pb.ReleaseSignal()))
        seen["released"] = (await call.read()).released
        call.cancel()
    return seen


async def test_a_step_beyond_the_credits_is_refused_and_accepted_once_credits_return(route2):
    seen = await aio(_steps_beyond_credits, route2[1].endpoint)
    assert seen["limits"].credits == 2
    assert seen["errors"] == [(3, "FLOW_CONTROL_VIOLATION", False)]
    assert seen["results"] == [1, 2]
    retry = seen["retry"]
    assert retry.HasField("result")
    assert retry.result.step_id == 3
    assert not retry.result.duplicate  # the refused step was never executed
    assert seen["released"] is True


async def _paused_generate(peers: list[str]) -> dict[str, object]:
    seen: dict[str, object] = {}
    caps = await check_route(peers)
    caps[0].limits.credits = 2
    rs = RouteSession(peers, caps, GenerateConfig(prompt="", max_tokens=9), NodeIdentity.generate())
    try:
        accepted = await rs.open()
        seen["credits"] = accepted.limits.credits
        before = (await health(peers[0], 5.0)).steps_total
        first = await rs.step([1, 504, 1233, 4683, 3588, 359], sample=True)
        g = pb.Generate(first_step_id=rs.step_id + 1, token=first.token, n_past=rs.n_past, max_tokens=8)
        await rs._write(pb.SessionFrame(route_session_id=rs.id, route_epoch=rs.epoch, generate=g))
        got = [(await rs._read()).result for _ in range(2)]
        await asyncio.sleep(1.0)  # unpaused, the head would finish all 8 steps in well under this
        seen["head_steps_while_paused"] = (await health(peers[0], 5.0)).steps_total - before
        await rs._write(pb.SessionFrame(route_session_id=rs.id, route_epoch=rs.epoch,
                                        credit=pb.CreditGrant(credits=6)))
        got += [(await rs._read()).result for _ in range(6)]
        seen["tokens"] = [first.token, *(r.token for r in got)]
        seen["last"] = [r.last for r in got]
        await rs.release()
    finally:
        await rs.close()
    # the same tokens without any pause: flow control must not change the output
    rs2 = RouteSession(peers, await check_route(peers), GenerateConfig(prompt="", max_tokens=9))
    try:
        await rs2.open()
        first = await rs2.step([1, 504, 1233, 4683, 3588, 359], sample=True)
        seen["unpaused"] = [first.token, *[r.token async for r in rs2.generate(first.token, 8)]]
        await rs2.release()
    finally:
        await rs2.close()
    return seen


async def test_a_generate_pauses_without_credits_and_a_grant_resumes_it(route2):
    seen = await aio(_paused_generate, [n.endpoint for n in route2])
    assert seen["credits"] == 2
    assert seen["head_steps_while_paused"] == 1 + 2  # the prefill, then two credited decode steps
    assert seen["last"] == [False] * 7 + [True]
    assert seen["tokens"] == seen["unpaused"]
