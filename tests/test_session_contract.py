"""The session contract on a real node: duplicates, epochs, cancel, release."""

from __future__ import annotations

import uuid

import grpc
import numpy as np

from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.wire.schema import SCHEMA_VERSION
from meshnode.wire.tensors import encode_bundle
from tests.conftest import aio, open_frame


def _open(sid: str, cap: pb.Capability) -> pb.SessionFrame:
    return open_frame(sid, cap)


def _step(sid: str, step_id: int, x: np.ndarray, n_past: int, *, epoch: int = 1, work: str = "") -> pb.SessionFrame:
    return pb.SessionFrame(route_session_id=sid, route_epoch=epoch, step=pb.Step(
        step_id=step_id, work_id=work, activation=encode_bundle(x, pos_start=n_past), sample=True,
        cache=pb.CacheExpectation(n_past=n_past)))


async def _contract(endpoint: str) -> dict[str, object]:
    seen: dict[str, object] = {}
    x = np.random.default_rng(3).standard_normal((2, 576)).astype(np.float32)
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = pb_grpc.NodeStub(ch)
        cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
        health0 = await stub.Health(pb.HealthRequest())
        sid = str(uuid.uuid4())
        call = stub.Session()
        await call.write(_open(sid, cap))
        seen["accepted"] = (await call.read()).accepted
        seen["live_during"] = (await stub.Health(pb.HealthRequest())).live_sessions - health0.live_sessions
        await call.write(_step(sid, 1, x, 0))
        first = (await call.read()).result
        await call.write(_step(sid, 1, x, 0))  # the same step again: acknowledged, not re-run
        seen["dup"] = (await call.read()).result
        seen["first"] = first
        await call.write(_step(sid, 2, x[:1], 2, epoch=7))
        seen["stale"] = (await call.read()).error
        await call.write(pb.SessionFrame(route_session_id=sid, route_epoch=1, cancel=pb.CancelSignal(work_id="w3")))
        seen["cancel_ack"] = (await call.read()).error
        await call.write(_step(sid, 3, x[:1], 2, work="w3"))
        seen["cancelled_item"] = (await call.read()).error
        await call.write(_step(sid, 4, x[:1], 2))
        seen["after"] = (await call.read()).result
        seen["released_oob"] = (await stub.Release(pb.ReleaseRequest(route_session_id=sid))).released
        seen["released_again"] = (await stub.Release(pb.ReleaseRequest(route_session_id=sid))).released
        call.cancel()
        # a Cancel that arrives before its Open
        sid2 = str(uuid.uuid4())
        seen["early_cancel"] = (await stub.Cancel(pb.CancelRequest(route_session_id=sid2))).cancelled
        call2 = stub.Session()
        await call2.write(_open(sid2, cap))
        seen["open_after_cancel"] = (await call2.read()).error
        call2.cancel()
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
    assert s["released_oob"] is True
    assert s["released_again"] is False
    assert s["early_cancel"] is True
    assert pb.ErrorCode.Name(s["open_after_cancel"].code) == "CANCELLED"
    assert s["live_after"] == 0
