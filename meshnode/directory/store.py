"""A store of directory records that converges whatever order updates arrive in (pure: time comes in).

Per node id only the record with the highest sequence number is kept, until it expires; a newer
record of a leaving node is kept too (a tombstone: the leave spreads like any update, and a lookup
leaves it out). So two stores that have seen the same records hold the same thing, in any order of
arrival, and a digest of the store says whether two hold the same: ``digests`` hashes each of
``BUCKETS`` buckets of (node id, seq) pairs, so two stores compare in a few kB and then exchange only
the buckets that differ (directory/sync.py). The store is bounded (``max_records``): when full, a new
node's record displaces the one that expires soonest, or is refused (``full``) if it would expire
sooner still; one key holds at most one record, so a flooding key costs one slot, and many keys cost
at most ``max_records``.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable

from meshnode.directory.records import Record, RecordRefused, check
from meshnode.proto import node_pb2 as pb

BUCKETS = 256
#: records a store holds at most
MAX_RECORDS = 100_000


def bucket_of(node_id: str) -> int:
    return hashlib.sha256(node_id.encode()).digest()[0] % BUCKETS


class RecordStore:
    def __init__(self, max_records: int = MAX_RECORDS, *, attest: bool = True) -> None:
        self.max_records = max_records
        self.attest = attest
        self.records: dict[str, Record] = {}
        #: refusals by reason (directory/records.py REASONS, and "full")
        self.refused: collections.Counter[str] = collections.Counter()
        self.accepted = 0
        self._buckets: list[dict[str, int]] = [{} for _ in range(BUCKETS)]
        self._digests: list[bytes | None] = [None] * BUCKETS

    # -- what comes in ----------------------------------------------------------------------------

    def offer(self, env: pb.SignedEnvelope, now: int) -> bool:
        """Keep ``env`` if it is a valid record newer than the one kept for its node; True if kept."""
        try:
            rec = check(env, now=now, attest=self.attest)
        except RecordRefused as e:
            self.refused[e.reason] += 1
            return False
        return self.keep(rec, now)

    def keep(self, rec: Record, now: int) -> bool:
        """Keep a checked record (``offer`` less the check); True if kept."""
        old = self.records.get(rec.node_id)
        if old is not None and old.expires > now and rec.seq <= old.seq:
            self.refused["stale"] += 1
            return False
        if old is None and len(self.records) >= self.max_records:
            self.expire(now)
            if len(self.records) >= self.max_records:
                victim = min(self.records.values(), key=lambda r: r.expires)
                if victim.expires >= rec.expires:
                    self.refused["full"] += 1
                    return False
                self._drop(victim.node_id)
        self.records[rec.node_id] = rec
        b = bucket_of(rec.node_id)
        self._buckets[b][rec.node_id] = rec.seq
        self._digests[b] = None
        self.accepted += 1
        return True

    def expire(self, now: int) -> list[str]:
        gone = [nid for nid, r in self.records.items() if r.expires <= now]
        for nid in gone:
            self._drop(nid)
        return gone

    def _drop(self, node_id: str) -> None:
        self.records.pop(node_id, None)
        b = bucket_of(node_id)
        self._buckets[b].pop(node_id, None)
        self._digests[b] = None

    # -- what goes out ----------------------------------------------------------------------------

    def live(self, now: int, model: str | None = None) -> list[Record]:
        """Unexpired records of nodes that are not leaving (of ``model``, a model id, if given)."""
        return [r for r in self.records.values() if r.expires > now and not r.advert.leaving
                and (model is None or r.model_id == model)]

    def digests(self) -> list[bytes]:
        """Per bucket, a digest of its (node id, seq) pairs (16 bytes each)."""
        for b in range(BUCKETS):
            if self._digests[b] is None:
                h = hashlib.sha256()
                for nid, seq in sorted(self._buckets[b].items()):
                    h.update(f"{nid}:{seq}\n".encode())
                self._digests[b] = h.digest()[:16]
        return [d for d in self._digests if d is not None]

    def entries(self, buckets: Iterable[int]) -> dict[str, int]:
        """node id -> seq of the records in ``buckets``."""
        out: dict[str, int] = {}
        for b in buckets:
            if 0 <= b < BUCKETS:
                out.update(self._buckets[b])
        return out

    def envelopes(self, node_ids: Iterable[str]) -> list[pb.SignedEnvelope]:
        return [self.records[n].envelope for n in node_ids if n in self.records]

    @property
    def bytes_held(self) -> int:
        return sum(r.size for r in self.records.values())
