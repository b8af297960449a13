"""Signed route sessions: the initiator's orders, the forwarder's proof, the hop's acceptance.

The initiator signs one ``RouteOpen`` per hop (session id, epoch, model,
the hop's range, the previous and next hop's node ids, the previous party's
public key, a fresh nonce, issue time, expiry). A hop checks it with
``check_open`` — a pure function of the envelopes, the hop's own identity and
range, ``now`` and the nonces it has already accepted — and each failure has
its own error code: forged, expired, replayed, mismatched, unauthenticated.

"Only from the previous hop named": the head's feeder is the initiator, whose
signature is the open itself; every later hop's stream is opened by the
previous hop, which proves who it is by signing a ``RouteForward`` for the
exact nonce with the key the initiator vouched for in ``prev_public_key``.
Every frame on that stream then belongs to that authenticated peer.
(The stream itself is plain TCP; confidentiality against an on-path
attacker needs TLS, which a later issue adds.)
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from meshnode import errors
from meshnode.identity.attest import CLOCK_SKEW, open_signed, seal
from meshnode.identity.keys import NodeIdentity, node_id_of
from meshnode.proto import node_pb2 as pb

OPEN_TYPE = "meshnode.v1.RouteOpen"
FORWARD_TYPE = "meshnode.v1.RouteForward"
ACCEPT_TYPE = "meshnode.v1.RouteAccept"
#: an open must be used within this many seconds
OPEN_TTL = 60


@dataclass(frozen=True)
class HopPlan:
    """What the initiator knows of one hop when it signs the route."""

    node_id: str
    public_key: bytes
    start: int
    end: int


def sign_route(ident: NodeIdentity, *, session_id: str, epoch: int, fingerprint: str, hops: list[HopPlan],
               now: int, ttl: int = OPEN_TTL, audit: bool = False) -> list[pb.SignedEnvelope]:
    """One signed RouteOpen per hop, in route order (``audit``: one hop, fed by the initiator, that
    answers with seals and forwards nothing)."""
    out = []
    for i, h in enumerate(hops):
        prev_id, prev_key = (ident.node_id, ident.public_key) if i == 0 else (hops[i - 1].node_id,
                                                                              hops[i - 1].public_key)
        o = pb.RouteOpen(
            route_session_id=session_id, route_epoch=epoch, model_fingerprint=fingerprint,
            range=pb.LayerRange(start=h.start, end=h.end), hop_node_id=h.node_id,
            prev_node_id=prev_id, prev_public_key=prev_key,
            next_node_id=hops[i + 1].node_id if i + 1 < len(hops) else "",
            nonce=os.urandom(16), issued_at_unix=now, expires_at_unix=now + ttl, initiator_node_id=ident.node_id,
            audit=audit,
        )
        out.append(seal(ident, OPEN_TYPE, o.SerializeToString()))
    return out


def forward_proof(ident: NodeIdentity, route_open: pb.RouteOpen) -> pb.SignedEnvelope:
    """The previous hop's signed proof, for the next hop's open."""
    f = pb.RouteForward(route_session_id=route_open.route_session_id, nonce=route_open.nonce,
                        forwarder_node_id=ident.node_id)
    return seal(ident, FORWARD_TYPE, f.SerializeToString())


def parse_open(env: pb.SignedEnvelope) -> pb.RouteOpen:
    try:
        o = open_signed(env, OPEN_TYPE, pb.RouteOpen)
    except errors.SignatureError as e:
        raise errors.OpenForgedError(f"route open: {e.message}") from e
    if o.initiator_node_id != node_id_of(env.signer_public_key):
        raise errors.OpenForgedError("route open names an initiator other than its signer")
    return o


def check_open(msg: pb.SessionOpen, *, own_node_id: str, fingerprint: str, start: int, end: int, now: int,
               seen_nonces: MutableMapping[bytes, int]) -> pb.RouteOpen:
    """The hop's verdict on a SessionOpen; on success the nonce is recorded as used."""
    if not msg.HasField("signed_open"):
        raise errors.OpenForgedError("the open carries no signed RouteOpen")
    o = parse_open(msg.signed_open)
    if now > o.expires_at_unix:
        raise errors.OpenExpiredError(f"route open expired {now - o.expires_at_unix}s ago")
    if o.issued_at_unix > now + CLOCK_SKEW:
        raise errors.OpenExpiredError(f"route open is issued {o.issued_at_unix - now}s in the future")
    for k in [k for k, exp in seen_nonces.items() if exp < now]:
        del seen_nonces[k]
    if o.nonce in seen_nonces:
        raise errors.OpenReplayedError("this route open was already used (nonce seen before)")
    checks = [
        ("hop", o.hop_node_id, own_node_id),
        ("model", o.model_fingerprint, fingerprint),
        ("range", (o.range.start, o.range.end), (start, end)),
        ("session", o.route_session_id, msg.route_session_id),
        ("epoch", o.route_epoch, msg.route_epoch),
        ("session model", o.model_fingerprint, msg.model_fingerprint),
        ("session range", (o.range.start, o.range.end), (msg.range.start, msg.range.end)),
    ]
    for what, signed, actual in checks:
        if signed != actual:
            raise errors.OpenMismatchError(f"the signed open's {what} is {signed!r}, not {actual!r}")
    if o.prev_node_id != o.initiator_node_id:
        _check_forwarder(msg, o)
    seen_nonces[o.nonce] = o.expires_at_unix
    return o


def _check_forwarder(msg: pb.SessionOpen, o: pb.RouteOpen) -> None:
    if not msg.HasField("forwarder_proof"):
        raise errors.OpenUnauthenticatedError(f"the stream does not prove it comes from {o.prev_node_id}")
    if node_id_of(o.prev_public_key) != o.prev_node_id:
        raise errors.OpenForgedError("the open's prev_public_key is not the previous hop's key")
    env = msg.forwarder_proof
    if env.signer_public_key != o.prev_public_key:
        raise errors.OpenUnauthenticatedError(f"the stream is signed by someone other than {o.prev_node_id}")
    try:
        f = open_signed(env, FORWARD_TYPE, pb.RouteForward)
    except errors.SignatureError as e:
        raise errors.OpenUnauthenticatedError(f"forwarder proof: {e.message}") from e
    if f.nonce != o.nonce or f.route_session_id != o.route_session_id or f.forwarder_node_id != o.prev_node_id:
        raise errors.OpenUnauthenticatedError("the forwarder's proof is for another open")


def accept(ident: NodeIdentity, o: pb.RouteOpen) -> pb.SignedEnvelope:
    a = pb.RouteAccept(route_session_id=o.route_session_id, route_epoch=o.route_epoch, hop_node_id=ident.node_id,
                       nonce=o.nonce, range=o.range)
    return seal(ident, ACCEPT_TYPE, a.SerializeToString())


def check_acceptances(acceptances: list[pb.SignedEnvelope], opens: list[pb.SignedEnvelope],
                      hops: list[HopPlan]) -> None:
    """The initiator's check: each hop accepted its own open, signed by the key it attested with."""
    if len(acceptances) != len(hops):
        raise errors.OpenMismatchError(f"{len(acceptances)} acceptances for a route of {len(hops)} hops")
    for env, sent, hop in zip(acceptances, opens, hops, strict=True):
        if env.signer_public_key != hop.public_key:
            raise errors.SignatureError(f"acceptance of {hop.node_id} is signed by another key")
        a = open_signed(env, ACCEPT_TYPE, pb.RouteAccept)
        o = pb.RouteOpen.FromString(sent.payload)  # the initiator's own, signed by it
        if a.nonce != o.nonce or a.hop_node_id != hop.node_id or a.route_session_id != o.route_session_id:
            raise errors.OpenMismatchError(f"{hop.node_id} accepted something other than its open")


CONTROL_TYPE = "meshnode.v1.ControlOrder"


def sign_control(ident: NodeIdentity, session_id: str, action: str, *, work_id: str = "",
                 now: int) -> pb.SignedEnvelope:
    order = pb.ControlOrder(route_session_id=session_id, action=action, work_id=work_id, issued_at_unix=now)
    return seal(ident, CONTROL_TYPE, order.SerializeToString())


def check_control(env: pb.SignedEnvelope, *, session_id: str, action: str, work_id: str, now: int) -> str:
    """The signer's node id, if ``env`` is a fresh order for exactly this action."""
    try:
        order = open_signed(env, CONTROL_TYPE, pb.ControlOrder)
    except errors.SignatureError as e:
        raise errors.OpenForgedError(f"control order: {e.message}") from e
    if (order.route_session_id, order.action, order.work_id) != (session_id, action, work_id):
        raise errors.OpenMismatchError("the signed order is for another session or action")
    if abs(now - order.issued_at_unix) > CLOCK_SKEW:
        raise errors.OpenExpiredError("the signed order is stale")
    return node_id_of(env.signer_public_key)
