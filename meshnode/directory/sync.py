"""Reconciling two record stores by digests, not dumps (pure).

One round between A and B:

1. A sends its bucket digests (``BUCKETS`` x 16 bytes, 4 kB);
2. B answers with its (node id, seq) pairs of the buckets whose digests differ (``differing``);
3. A works out which records B has newer or A lacks (it asks for those), and which A has newer or B
   lacks (it sends those): ``plan``. Every record received goes through the receiving store's own
   checks (a peer's records are trusted no more than a node's).

Two stores in step exchange only the digests; one new record costs its bucket's pairs and the
record. Each side's ``offer`` keeps only what is newer, so rounds in any order converge.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnode.directory.store import RecordStore
from meshnode.proto import node_pb2 as pb


def differing(mine: Sequence[bytes], theirs: Sequence[bytes]) -> list[int]:
    """The buckets whose digests differ (all of them when the lists are not the same length)."""
    if len(mine) != len(theirs):
        return list(range(len(mine)))
    return [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]


def plan(mine: dict[str, int], theirs: dict[str, int]) -> tuple[list[str], list[str]]:
    """(ids to ask them for: theirs newer or only theirs, ids to send them: mine newer or only mine)."""
    want = sorted(n for n, s in theirs.items() if s > mine.get(n, -1))
    give = sorted(n for n, s in mine.items() if s > theirs.get(n, -1))
    return want, give


def batch(envs: Sequence[pb.SignedEnvelope]) -> bytes:
    return pb.RecordBatch(records=list(envs)).SerializeToString()


def round_between(a: RecordStore, b: RecordStore, now: int) -> int:
    """One reconcile round of ``a`` with ``b``, in process (the simulation's and the tests' model of what
    the trackers do over HTTP); returns the bytes it would have sent both ways."""
    sent = 16 * len(a.digests())
    buckets = differing(a.digests(), b.digests())
    theirs = b.entries(buckets)
    sent += sum(len(n) + 8 for n in theirs)
    want, give = plan(a.entries(buckets), theirs)
    for env in b.envelopes(want):
        sent += env.ByteSize()
        a.offer(env, now)
    for env in a.envelopes(give):
        sent += env.ByteSize()
        b.offer(env, now)
    return sent
