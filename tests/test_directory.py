"""The directory's records, stores and sync (meshnode/directory): every store refuses what it must and
counts why, stores converge whatever order records arrive in, and 1,000 nodes' records converge across
3 trackers within two sync periods (an in-process simulation on trio's virtual clock)."""

from __future__ import annotations

import random
import time

import pytest
import trio
import trio.testing

from meshnode.directory.records import MAX_LIFETIME, RecordRefused, check
from meshnode.directory.store import BUCKETS, RecordStore
from meshnode.directory.sync import differing, plan, round_between
from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise
from meshnode.identity.attest import CLOCK_SKEW, attest, seal
from meshnode.proto import node_pb2 as pb

MODEL = "ab" * 32


def _cap(ident: NodeIdentity, now: int, a: int = 0, b: int = 15, model: str = MODEL) -> pb.Capability:
    return pb.Capability(node_id=ident.node_id, model_fingerprint=model, model_name="m", n_layer=30,
                         range=pb.LayerRange(start=a, end=b), range_digest="cd" * 32, endpoints=["198.18.0.1:7001"],
                         attestation=attest(ident, fingerprint=model, start=a, end=b, range_digest="cd" * 32,
                                            llama_build="x", now=now))


def _record(ident: NodeIdentity, now: int, seq: int, *, ttl: int = 60, leaving: bool = False,
            issued: int | None = None, model: str = MODEL) -> pb.SignedEnvelope:
    return advertise(ident, _cap(ident, now, model=model), pb.HealthReply(), seq=seq,
                     now=now if issued is None else issued, ttl=ttl, leaving=leaving)


def test_every_bad_record_is_refused_with_its_reason() -> None:
    now = int(time.time())
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    good = _record(me, now, 5)
    rec = check(good, now=now)
    assert (rec.node_id, rec.seq, rec.expires) == (me.node_id, 5, now + 60)
    tampered = pb.SignedEnvelope()
    tampered.CopyFrom(good)
    tampered.payload = good.payload[:-1] + bytes([good.payload[-1] ^ 1])
    stolen = advertise(other, _cap(me, now), pb.HealthReply(), seq=6, now=now)  # another key signs my entry
    as_other_kind = seal(me, "meshnode.v1.Attestation", good.payload)  # the same bytes, another domain
    cases = {
        "forged": [tampered, as_other_kind, pb.SignedEnvelope()],
        "foreign_key": [stolen],
        "far_future": [_record(me, now, 7, issued=now + CLOCK_SKEW + 60)],
        "expired": [_record(me, now - 120, 8, ttl=60)],
        "malformed": [_record(me, now, 9, ttl=MAX_LIFETIME + 10)],
        "oversized": [pb.SignedEnvelope(payload=b"x" * 20_000)],
    }
    for reason, envs in cases.items():
        for env in envs:
            with pytest.raises(RecordRefused) as e:
                check(env, now=now)
            assert e.value.reason == reason, (reason, str(e.value))
    with pytest.raises(RecordRefused, match="stale"):
        check(good, now=now, known_seq=5)
    store = RecordStore()
    for envs in cases.values():
        for env in envs:
            assert not store.offer(env, now)
    assert store.offer(good, now)
    assert not store.offer(good, now)  # a replay
    assert dict(store.refused) == {"forged": 3, "foreign_key": 1, "far_future": 1, "expired": 1, "malformed": 1,
                                   "oversized": 1, "stale": 1}


def test_stores_converge_whatever_order_records_arrive_in() -> None:
    now = int(time.time())
    ids = [NodeIdentity.generate() for _ in range(12)]
    updates = [_record(i, now, seq) for i in ids for seq in (1, 2, 3)]
    updates += [_record(ids[0], now, 4, leaving=True)]  # a leave spreads like any update
    stores = []
    for seed in range(4):
        order = updates[:]
        random.Random(seed).shuffle(order)
        s = RecordStore()
        for env in order:
            s.offer(env, now)
        stores.append(s)
    first = stores[0]
    assert all(s.digests() == first.digests() for s in stores)
    assert {r.seq for r in first.records.values()} == {3, 4}
    assert ids[0].node_id not in {r.node_id for r in first.live(now)}  # the leaving node is not looked up
    assert len(first.live(now, MODEL)) == 11
    assert first.expire(now + 61)
    assert not first.records


def test_a_full_store_keeps_the_longest_lived_and_a_flooding_key_costs_one_slot() -> None:
    now = int(time.time())
    s = RecordStore(max_records=3)
    flood = NodeIdentity.generate()
    for seq in range(1, 50):
        s.offer(_record(flood, now, seq), now)
    assert len(s.records) == 1
    short = NodeIdentity.generate()
    s.offer(_record(short, now, 1, ttl=10), now)
    s.offer(_record(NodeIdentity.generate(), now, 1, ttl=100), now)
    assert len(s.records) == 3
    late = NodeIdentity.generate()
    assert s.offer(_record(late, now, 1, ttl=200), now)  # displaces the one that expires soonest
    assert short.node_id not in s.records
    assert not s.offer(_record(NodeIdentity.generate(), now, 1, ttl=5), now)
    assert s.refused["full"] == 1


def test_sync_sends_digests_then_only_what_differs() -> None:
    now = int(time.time())
    a, b = RecordStore(), RecordStore()
    nodes = [NodeIdentity.generate() for _ in range(40)]
    for i, n in enumerate(nodes):
        (a if i % 2 else b).offer(_record(n, now, 1), now)
    assert len(differing(a.digests(), b.digests())) > 0
    round_between(a, b, now)
    assert a.digests() == b.digests()
    assert len(a.records) == len(b.records) == 40
    steady = round_between(a, b, now)
    assert steady == 16 * BUCKETS  # in step: the digests alone
    assert plan({"x": 2, "y": 1}, {"x": 1, "z": 5}) == (["z"], ["x", "y"])


def _fleet(n: int, now: int, models: int = 10) -> list[pb.SignedEnvelope]:
    """``n`` nodes' records, spread over ``models`` models (each node carries its own model's records)."""
    return [_record(NodeIdentity.generate(), now, 1, ttl=600, model=f"{i % models:064x}") for i in range(n)]


def _model_of(env: pb.SignedEnvelope) -> str:
    return pb.Advertisement.FromString(env.payload).capability.model_fingerprint


async def _simulate(records: list[pb.SignedEnvelope], period: float, start: int) -> tuple[int, list[int]]:
    """Each node registers with one tracker at random; every ``period`` (virtual) seconds the three
    trackers reconcile with each other by digests, and each node takes from its tracker the records of
    its model (what its carried directory does). Returns the sync periods until every tracker holds
    every record and every node every record of its model, and the bytes of each period's rounds."""
    trackers = [RecordStore(), RecordStore(), RecordStore()]
    rng = random.Random(7)
    mine = [rng.randrange(3) for _ in records]
    nodes = [RecordStore() for _ in records]
    for env, t, node in zip(records, mine, nodes, strict=True):
        trackers[t].offer(env, start)
        node.offer(env, start)  # its own record
    want = {pb.Advertisement.FromString(e.payload).capability.node_id for e in records}
    by_model: dict[str, set[str]] = {}
    for e in records:
        by_model.setdefault(_model_of(e), set()).add(pb.Advertisement.FromString(e.payload).capability.node_id)

    def converged() -> bool:
        return all(set(t.records) == want for t in trackers) and all(
            set(n.records) == by_model[_model_of(e)] for n, e in zip(nodes, records, strict=True))

    periods, sent = 0, []
    while not converged():
        await trio.sleep(period)
        periods += 1
        now = start + int(trio.current_time())
        total = 0
        for i, t in enumerate(trackers):  # each reconciles with its peers, in turn
            for j, peer in enumerate(trackers):
                if i != j:
                    total += round_between(t, peer, now)
        for env, t, node in zip(records, mine, nodes, strict=True):
            for r in trackers[t].live(now, _model_of(env)):
                total += r.size
                node.offer(r.envelope, now)
        sent.append(total)
        assert periods <= 2, "records did not converge within two sync periods"
    return periods, sent


def test_a_thousand_nodes_converge_across_three_trackers_and_the_nodes_within_two_sync_periods() -> None:
    now = int(time.time())
    records = _fleet(1000, now)
    clock = trio.testing.MockClock(autojump_threshold=0)
    periods, sent = trio.run(_simulate, records, 10.0, now, clock=clock)
    assert periods <= 2
    assert all(b > 0 for b in sent)
    # a lookup of a model from a store in memory: its nodes, none twice
    store = RecordStore()
    for env in records:
        store.offer(env, now)
    one = _model_of(records[0])
    assert len(store.live(now, one)) == 100
    assert len({r.node_id for r in store.live(now, one)}) == 100
