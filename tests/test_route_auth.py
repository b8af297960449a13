"""Signed route sessions: each bad open is refused with its own code, on a live node."""

from __future__ import annotations

import time
import uuid

from meshnode.identity import NodeIdentity
from meshnode.identity.attest import seal
from meshnode.identity.routeauth import OPEN_TYPE, HopPlan, forward_proof, sign_route
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport.client import open_channel
from meshnode.wire.schema import SCHEMA_VERSION
from tests.conftest import aio, open_frame


async def _try_open(endpoint: str, frame: pb.SessionFrame) -> pb.SessionReply:
    async with await open_channel(endpoint) as ch:
        call = pb_grpc.NodeStub(ch).Session()
        await call.write(frame)
        reply = await call.read()
        if reply.HasField("accepted"):
            await call.write(pb.SessionFrame(route_session_id=frame.route_session_id,
                                             route_epoch=frame.route_epoch, release=pb.ReleaseSignal()))
            await call.read()
        call.cancel()
        return reply


async def _cap(endpoint: str) -> pb.Capability:
    async with await open_channel(endpoint) as ch:
        return await pb_grpc.NodeStub(ch).GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))


def _code(reply: pb.SessionReply) -> str:
    return "ACCEPTED" if reply.HasField("accepted") else pb.ErrorCode.Name(reply.error.code)


async def _scenarios(tail_ep: str) -> dict[str, str]:
    cap = await _cap(tail_ep)
    me = NodeIdentity.generate()
    out: dict[str, str] = {}
    good = open_frame(str(uuid.uuid4()), cap, me)
    out["good"] = _code(await _try_open(tail_ep, good))
    out["replayed"] = _code(await _try_open(tail_ep, good))  # the very same signed open again
    out["expired"] = _code(await _try_open(tail_ep, open_frame(str(uuid.uuid4()), cap, me,
                                                               now=int(time.time()) - 3600)))
    forged = open_frame(str(uuid.uuid4()), cap, me)
    forged.open.signed_open.signature = bytes(64)
    out["forged"] = _code(await _try_open(tail_ep, forged))
    # a genuine open for one session presented for another
    other = open_frame(str(uuid.uuid4()), cap, me)
    other.route_session_id = other.open.route_session_id = str(uuid.uuid4())
    out["mismatched"] = _code(await _try_open(tail_ep, other))
    # an open addressed to another node
    stranger = pb.Capability()
    stranger.CopyFrom(cap)
    stranger.node_id = NodeIdentity.generate().node_id
    out["wrong_hop"] = _code(await _try_open(tail_ep, open_frame(str(uuid.uuid4()), stranger, me)))
    # the tail as the second hop: the stream must come from the head the open names
    head = NodeIdentity.generate()
    sid = str(uuid.uuid4())
    plans = [HopPlan(head.node_id, head.public_key, 0, 15),
             HopPlan(cap.node_id, cap.attestation.signer_public_key, 15, 30)]
    opens = sign_route(me, session_id=sid, epoch=1, fingerprint=cap.model_fingerprint, hops=plans,
                       now=int(time.time()))

    def second_hop(proof: pb.SignedEnvelope | None) -> pb.SessionFrame:
        o = pb.SessionOpen(schema_version=SCHEMA_VERSION, route_session_id=sid, route_epoch=1,
                           model_fingerprint=cap.model_fingerprint, range=cap.range, numerics=cap.numerics,
                           limits=cap.limits, signed_open=opens[1])
        if proof is not None:
            o.forwarder_proof.CopyFrom(proof)
        return pb.SessionFrame(route_session_id=sid, route_epoch=1, open=o)

    route_open = pb.RouteOpen.FromString(opens[1].payload)
    out["no_proof"] = _code(await _try_open(tail_ep, second_hop(None)))
    out["impostor"] = _code(await _try_open(tail_ep, second_hop(forward_proof(NodeIdentity.generate(), route_open))))
    out["by_the_named_head"] = _code(await _try_open(tail_ep, second_hop(forward_proof(head, route_open))))
    # an open signed by one key but claiming another initiator
    bad = pb.RouteOpen.FromString(opens[0].payload)
    bad.initiator_node_id = head.node_id
    claim = open_frame(str(uuid.uuid4()), cap, me)
    claim.open.signed_open.CopyFrom(seal(me, OPEN_TYPE, bad.SerializeToString()))
    out["claims_other_initiator"] = _code(await _try_open(tail_ep, claim))
    return out


async def test_bad_opens_are_refused_each_with_its_own_code(route2):
    got = await aio(_scenarios, route2[1].endpoint)
    assert got == {
        "good": "ACCEPTED",
        "replayed": "OPEN_REPLAYED",
        "expired": "OPEN_EXPIRED",
        "forged": "OPEN_FORGED",
        "mismatched": "OPEN_MISMATCH",
        "wrong_hop": "OPEN_MISMATCH",
        "no_proof": "OPEN_UNAUTHENTICATED",
        "impostor": "OPEN_UNAUTHENTICATED",
        "by_the_named_head": "ACCEPTED",
        "claims_other_initiator": "OPEN_FORGED",
    }


async def test_a_generation_verifies_every_hops_signed_acceptance(route3, reference):
    from meshnode.session.initiator import GenerateConfig, generate

    result = await aio(generate, [n.endpoint for n in route3], GenerateConfig(prompt="The three primary colors are",
                                                                                max_tokens=4),
                       NodeIdentity.generate())
    assert result.tokens == reference.tokens[:4]
