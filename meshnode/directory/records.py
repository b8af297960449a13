"""A directory record: a node's signed, versioned, expiring entry, checked the same way by every store.

A record is the node's ``SignedEnvelope(Advertisement)``: its node id, endpoints, model id, range and
capabilities (with the node's own attestation of its range), a sequence number that only grows, and
its issue and expiry times; signed by the node's Ed25519 key over a payload type of its own
(``meshnode.v1.Advertisement``), so it cannot be replayed as any other kind of signed message.
``check`` is what every store (tracker, node) runs before it keeps one, whoever it came from; each
refusal has its reason, which stores count.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass

from meshnode import errors
from meshnode.identity.advert import ADVERT_TYPE
from meshnode.identity.attest import CLOCK_SKEW, open_signed, verify_attestation
from meshnode.identity.keys import node_id_of
from meshnode.proto import node_pb2 as pb

#: bytes a record may take (a capability with its attestation is a few kB)
MAX_RECORD_BYTES = 16 * 1024
#: a record lives at most this long past its issue (a node re-issues every heartbeat)
MAX_LIFETIME = 3600
#: lifetime of a record that names no expiry (nodes from before ``expires_at_unix``)
DEFAULT_LIFETIME = 60

REASONS = ("forged", "foreign_key", "stale", "expired", "far_future", "oversized", "malformed")


class RecordRefused(errors.AttestationError):
    """A directory record that no store keeps; ``reason`` is one of ``REASONS``."""

    code = "RECORD_REFUSED"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class Record:
    node_id: str
    seq: int
    issued: int
    expires: int
    envelope: pb.SignedEnvelope
    advert: pb.Advertisement
    size: int

    @property
    def model_id(self) -> str:
        return self.advert.capability.model_fingerprint


def expiry(ad: pb.Advertisement) -> int:
    return int(ad.expires_at_unix) if ad.expires_at_unix else int(ad.issued_at_unix) + DEFAULT_LIFETIME


class _Verified:
    """Digests of envelopes whose signatures (and attestation) this process has verified: signatures
    depend on the bytes alone, so a record many stores of one process see (a simulation, a node that
    hears it from several peers) is verified once. Its times and seq are still checked each time."""

    def __init__(self, most: int = 200_000) -> None:
        self.most = most
        #: digest -> until when the verdict holds (its attestation's expiry)
        self.seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def has(self, key: bytes, now: int) -> bool:
        until = self.seen.get(key)
        if until is not None and now < until:
            self.seen.move_to_end(key)
            return True
        return False

    def add(self, key: bytes, until: int) -> None:
        self.seen[key] = until
        while len(self.seen) > self.most:
            self.seen.popitem(last=False)


_VERIFIED = _Verified()


def check(env: pb.SignedEnvelope, *, now: int, known_seq: int | None = None, attest: bool = True) -> Record:
    """The record if a store may keep it: its size, signature and payload type, its signer the node it
    names, issued no later than ``CLOCK_SKEW`` ahead, not expired, living no longer than ``MAX_LIFETIME``,
    newer than ``known_seq``, and (``attest``) its range attestation holding. ``RecordRefused`` with the
    reason otherwise."""
    size = env.ByteSize()
    if size > MAX_RECORD_BYTES:
        raise RecordRefused("oversized", f"a record of {size} bytes is over {MAX_RECORD_BYTES}")
    raw = env.SerializeToString(deterministic=True)
    key = hashlib.sha256(raw).digest()
    known = _VERIFIED.has(key, now)
    try:
        if known:
            if env.payload_type != ADVERT_TYPE:  # (a verified envelope has it; kept for the reader)
                raise errors.SignatureError("not an advertisement")
            ad = pb.Advertisement.FromString(env.payload)
        else:
            ad = open_signed(env, ADVERT_TYPE, pb.Advertisement)
    except errors.SignatureError as e:
        raise RecordRefused("forged", str(e)) from None
    except errors.MeshnodeError as e:
        raise RecordRefused("malformed", str(e)) from None
    cap = ad.capability
    signer = node_id_of(env.signer_public_key)
    if cap.node_id != signer:
        raise RecordRefused("foreign_key", f"a record of {cap.node_id[:12]}… signed by {signer[:12]}…")
    issued, expires = int(ad.issued_at_unix), expiry(ad)
    if issued > now + CLOCK_SKEW:
        raise RecordRefused("far_future", f"issued {issued - now} s ahead of this store's clock")
    if expires <= now:
        raise RecordRefused("expired", f"expired {now - expires} s ago")
    if expires - issued > MAX_LIFETIME or expires < issued:
        raise RecordRefused("malformed", f"a lifetime of {expires - issued} s (at most {MAX_LIFETIME})")
    if known_seq is not None and ad.seq <= known_seq:
        raise RecordRefused("stale", f"seq {ad.seq} is not newer than the {known_seq} kept")
    until = expires
    if attest and not ad.leaving and not known:
        try:
            att = verify_attestation(cap.attestation, now=now, fingerprint=cap.model_fingerprint,
                                     start=cap.range.start, end=cap.range.end, range_digest=cap.range_digest,
                                     node_id=cap.node_id)
            until = min(expires, int(att.expires_at_unix))
        except errors.SignatureError as e:
            raise RecordRefused("forged", f"its attestation: {e}") from None
        except errors.MeshnodeError as e:
            raise RecordRefused("malformed", f"its attestation: {e}") from None
    if (attest or ad.leaving) and not known:  # what was checked here whole is not checked again (until then)
        _VERIFIED.add(key, until)
    return Record(cap.node_id, int(ad.seq), issued, expires, env, ad, size)
