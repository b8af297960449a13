"""Signed envelopes and range attestations: making them, and the pure checks.

``verify_attestation`` takes the envelope and ``now`` and returns the
attestation or raises the typed error that says what is wrong: a forged or
tampered signature, a node id that is not the signer's key, an expired or
not-yet-valid statement, or one that attests to another model, range or
range digest than the capability it came with.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from meshnode import errors
from meshnode.identity.keys import NodeIdentity, node_id_of, verify_signature
from meshnode.proto import node_pb2 as pb

DOMAIN = b"meshnode-v1\0"
ATTESTATION_TYPE = "meshnode.v1.Attestation"
#: an attestation is renewed well before it expires
DEFAULT_TTL = 24 * 3600
#: clocks of peers may disagree this much
CLOCK_SKEW = 300


def _signed_bytes(payload_type: str, payload: bytes) -> bytes:
    # the type is part of what is signed: a payload cannot be replayed as another type
    return DOMAIN + payload_type.encode() + b"\0" + payload


def seal(ident: NodeIdentity, payload_type: str, payload: bytes) -> pb.SignedEnvelope:
    return pb.SignedEnvelope(payload_type=payload_type, payload=payload, signer_public_key=ident.public_key,
                             signature=ident.sign(_signed_bytes(payload_type, payload)))


def open_envelope(env: pb.SignedEnvelope, payload_type: str) -> bytes:
    """The payload, once the signature holds; SignatureError otherwise."""
    if env.payload_type != payload_type:
        raise errors.SignatureError(f"envelope carries {env.payload_type!r}, not {payload_type!r}")
    if len(env.signer_public_key) != 32 or not verify_signature(
        env.signer_public_key, _signed_bytes(env.payload_type, env.payload), env.signature
    ):
        raise errors.SignatureError("the signature does not verify (forged or tampered)")
    return env.payload


M = TypeVar("M", bound=Message)


def open_signed(env: pb.SignedEnvelope, payload_type: str, kind: type[M]) -> M:
    """The payload parsed as ``kind``, once the signature holds; SignatureError for a bad signature
    or a signed payload that does not parse (signed garbage is refused, never raised as DecodeError)."""
    payload = open_envelope(env, payload_type)
    try:
        return kind.FromString(payload)
    except DecodeError as e:
        raise errors.SignatureError(f"the signed {payload_type} does not parse: {e}") from None


def attest(ident: NodeIdentity, *, fingerprint: str, start: int, end: int, range_digest: str,
           llama_build: str, now: int, ttl: int = DEFAULT_TTL) -> pb.SignedEnvelope:
    a = pb.Attestation(node_id=ident.node_id, model_fingerprint=fingerprint,
                       range=pb.LayerRange(start=start, end=end), range_digest=range_digest,
                       llama_build=llama_build, issued_at_unix=now, expires_at_unix=now + ttl)
    return seal(ident, ATTESTATION_TYPE, a.SerializeToString())


def verify_attestation(env: pb.SignedEnvelope, *, now: int, fingerprint: str | None = None,
                       start: int | None = None, end: int | None = None, range_digest: str | None = None,
                       node_id: str | None = None) -> pb.Attestation:
    """The attestation in ``env`` if it is genuine, current, and says what is expected."""
    a = open_signed(env, ATTESTATION_TYPE, pb.Attestation)
    if a.node_id != node_id_of(env.signer_public_key):
        raise errors.SignatureError(f"attestation names node {a.node_id}, but was signed by another key")
    if now + CLOCK_SKEW < a.issued_at_unix:
        raise errors.AttestationExpiredError(f"attestation is issued in the future ({a.issued_at_unix - now}s ahead)")
    if now > a.expires_at_unix:
        raise errors.AttestationExpiredError(f"attestation expired {now - a.expires_at_unix}s ago")
    checks = [
        ("model", fingerprint, a.model_fingerprint),
        ("range start", start, a.range.start),
        ("range end", end, a.range.end),
        ("range digest", range_digest, a.range_digest),
        ("node id", node_id, a.node_id),
    ]
    for what, want, got in checks:
        if want is not None and want != got:
            raise errors.AttestationMismatchError(f"attestation's {what} is {got!r}, expected {want!r}")
    return a


def check_attested(endpoint: str, cap: pb.Capability, now: int) -> None:
    """A peer's capability must be vouched for by its own signed attestation (model, range, digest,
    node id); the error names ``endpoint``, the peer that claimed it. Pure."""
    try:
        verify_attestation(cap.attestation, now=now, fingerprint=cap.model_fingerprint, start=cap.range.start,
                           end=cap.range.end, range_digest=cap.range_digest, node_id=cap.node_id)
    except errors.MeshnodeError as e:
        e.hop = endpoint
        raise
