"""Signed advertisements for trackers: making one, and the pure check a tracker runs."""

from __future__ import annotations

from meshnode import errors
from meshnode.identity.attest import CLOCK_SKEW, open_signed, seal, verify_attestation
from meshnode.identity.keys import NodeIdentity, node_id_of
from meshnode.proto import node_pb2 as pb

ADVERT_TYPE = "meshnode.v1.Advertisement"


def advertise(ident: NodeIdentity, cap: pb.Capability, health: pb.HealthReply, *, seq: int, now: int,
              leaving: bool = False, ttl: int = 60) -> pb.SignedEnvelope:
    """The node's signed directory record, kept by stores until ``now + ttl`` (docs/directory.md)."""
    ad = pb.Advertisement(capability=cap, seq=seq, issued_at_unix=now, health=health, leaving=leaving,
                          expires_at_unix=now + ttl)
    return seal(ident, ADVERT_TYPE, ad.SerializeToString())


def verify_advert(env: pb.SignedEnvelope, *, now: int, last_seq: int | None) -> pb.Advertisement:
    """The advertisement if it is genuine, fresh, newer than ``last_seq``, and its attestation holds."""
    ad = open_signed(env, ADVERT_TYPE, pb.Advertisement)
    cap = ad.capability
    if cap.node_id != node_id_of(env.signer_public_key):
        raise errors.SignatureError("advertisement names a node other than its signer")
    if cap.attestation.signer_public_key != env.signer_public_key:
        raise errors.SignatureError("the advertised attestation is signed by another key")
    if abs(now - ad.issued_at_unix) > CLOCK_SKEW:
        raise errors.AttestationExpiredError(f"advertisement is {now - ad.issued_at_unix}s old or ahead")
    if last_seq is not None and ad.seq <= last_seq:
        raise errors.AdvertReplayedError(f"advertisement seq {ad.seq} is not newer than {last_seq}")
    verify_attestation(cap.attestation, now=now, fingerprint=cap.model_fingerprint, start=cap.range.start,
                       end=cap.range.end, range_digest=cap.range_digest, node_id=cap.node_id)
    return ad
