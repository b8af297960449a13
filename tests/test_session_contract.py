"""The session contract on a real node: duplicates, epochs, cancel, release."""

from __future__ import annotations

import time
import uuid

import grpc
import numpy as np

from meshnode.identity import NodeIdentity
from meshnode.identity.routeauth import sign_control
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport.client import open_channel
from meshnode.wire.schema import SCHEMA_VERSION
from tests.conftest import aio, open_frame, step_frame


async def _contract(endpoint: str) -> dict[str, object]:
    seen: dict[str, object] = {}
    x = np.random.default_rng(3).standard_normal((2, 576)).astype(np.float32)
    async with await open_channel(endpoint) as ch:
        stub = pb_grpc.NodeStub(ch)
        cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
        health0 = await stub.Health(pb.HealthRequest())
        sid = str(uuid.uuid4())
        me, stranger = NodeIdentity.generate(), NodeIdentity.generate()
        now = int(time.time())
        call = stub.Session()
        await call.write(open_frame(sid, cap, me))
        seen["accepted"] = (await call.read()).accepted
        seen["live_during"] = (await stub.Health(pb.HealthRequest())).live_sessions - health0.live_sessions
        await call.write(step_frame(sid, 1, x, 0, sample=True))
        first = (await call.read()).result
        await call.write(step_frame(sid, 1, x, 0, sample=True))  # the same step again: acknowledged, not re-run
        seen["dup"] = (await call.read()).result
        seen["first"] = first
        await call.write(step_frame(sid, 2, x[:1], 2, epoch=7, sample=True))
        seen["stale"] = (await call.read()).error
        await call.write(pb.SessionFrame(route_session_id=sid, route_epoch=1, cancel=pb.CancelSignal(work_id="w3")))
        seen["cancel_ack"] = (await call.read()).error
        await call.write(step_frame(sid, 3, x[:1], 2, work="w3", sample=True))
        seen["cancelled_item"] = (await call.read()).error
        await call.write(step_frame(sid, 4, x[:1], 2, sample=True))
        seen["after"] = (await call.read()).result
        # only the session's initiator may end it out of band
        for who, order in (("unsigned", pb.SignedEnvelope()),
                           ("stranger", sign_control(stranger, sid, "release", now=now)),
                           ("wrong_action", sign_control(me, sid, "cancel", now=now))):
            try:
                await stub.Release(pb.ReleaseRequest(route_session_id=sid, auth=order))
                seen[f"release_by_{who}"] = "ALLOWED"
            except grpc.aio.AioRpcError as e:
                seen[f"release_by_{who}"] = e.code().name
        await call.write(step_frame(sid, 5, x[:1], 3, sample=True))
        seen["still_serving"] = (await call.read()).result
        release = sign_control(me, sid, "release", now=now)
        seen["released_oob"] = (await stub.Release(pb.ReleaseRequest(route_session_id=sid, auth=release))).released
        seen["released_again"] = (await stub.Release(pb.ReleaseRequest(route_session_id=sid, auth=release))).released
        call.cancel()
        # a Cancel that arrives before its Open (and binds only its own initiator's open)
        sid2 = str(uuid.uuid4())
        cancel = sign_control(me, sid2, "cancel", now=now)
        seen["early_cancel"] = (await stub.Cancel(pb.CancelRequest(route_session_id=sid2, auth=cancel))).cancelled
        call2 = stub.Session()
        await call2.write(open_frame(sid2, cap, me))
        seen["open_after_cancel"] = (await call2.read()).error
        call2.cancel()
        # a stranger's early cancel does not stop the real initiator's session
        sid3 = str(uuid.uuid4())
        await stub.Cancel(pb.CancelRequest(route_session_id=sid3, auth=sign_control(stranger, sid3, "cancel", now=now)))
        call3 = stub.Session()
        await call3.write(open_frame(sid3, cap, me))
        seen["open_despite_stranger"] = (await call3.read()).HasField("accepted")
        await call3.write(pb.SessionFrame(route_session_id=sid3, route_epoch=1, release=pb.ReleaseSignal()))
        await call3.read()
        call3.cancel()
        seen["live_after"] = (await stub.Health(pb.HealthRequest())).live_sessions - health0.live_sessions
    return seen


async def test_session_contract_on_a_real_tail(route2):
    s = await aio(_contract, route2[1].endpoint)
    acc = s["accepted"]
    assert acc.limits.max_prefill_chunk_tokens == 512
    assert acc.hops[0].range.start == 15
    assert s["live_during"] == 1
    assert s["dup"].duplicate
    assert s["dup"].token == s["first"].token
    assert pb.ErrorCode.Name(s["stale"].code) == "EPOCH_STALE"
    assert not s["stale"].terminal
    assert pb.ErrorCode.Name(s["cancel_ack"].code) == "CANCELLED"
    assert pb.ErrorCode.Name(s["cancelled_item"].code) == "CANCELLED"
    assert not s["cancelled_item"].terminal
    # the session goes on at position 2: the cancelled item and the stale step ran nothing
    assert s["after"].step_id == 4
    assert s["release_by_unsigned"] == "PERMISSION_DENIED"
    assert s["release_by_stranger"] == "PERMISSION_DENIED"
    assert s["release_by_wrong_action"] == "PERMISSION_DENIED"
    assert s["still_serving"].step_id == 5
    assert s["released_oob"] is True
    assert s["released_again"] is False
    assert s["early_cancel"] is True
    assert pb.ErrorCode.Name(s["open_after_cancel"].code) == "CANCELLED"
    assert s["open_despite_stranger"] is True
    assert s["live_after"] == 0


async def _deadlines(endpoint: str) -> dict[str, object]:
    seen: dict[str, object] = {}
    x = np.random.default_rng(4).standard_normal((1, 576)).astype(np.float32)
    async with await open_channel(endpoint) as ch:
        stub = pb_grpc.NodeStub(ch)
        cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
        me = NodeIdentity.generate()
        late = open_frame(str(uuid.uuid4()), cap, me)
        late.open.deadline_unix_nanos = time.time_ns() - 1_000_000_000
        call = stub.Session()
        await call.write(late)
        seen["late_open"] = (await call.read()).error
        call.cancel()
        sid = str(uuid.uuid4())
        call = stub.Session()
        await call.write(open_frame(sid, cap, me))
        await call.read()
        step = step_frame(sid, 1, x, 0, sample=True)
        step.step.deadline_unix_nanos = time.time_ns() - 1_000_000
        await call.write(step)
        seen["late_step"] = (await call.read()).error
        await call.write(step_frame(sid, 2, x, 0, sample=True))  # the late step ran nothing: position 0 is still free
        seen["next"] = (await call.read()).result
        await call.write(pb.SessionFrame(route_session_id=sid, route_epoch=1, release=pb.ReleaseSignal()))
        await call.read()
        call.cancel()
    return seen


async def test_an_expired_open_or_step_is_refused_and_runs_nothing(route2):
    s = await aio(_deadlines, route2[1].endpoint)
    assert pb.ErrorCode.Name(s["late_open"].code) == "DEADLINE_EXCEEDED"
    assert pb.ErrorCode.Name(s["late_step"].code) == "DEADLINE_EXCEEDED"
    assert not s["late_step"].terminal
    assert s["next"].step_id == 2
