"""mDNS discovery between real node processes on loopback (127.0.0.1 only)."""

from __future__ import annotations

import functools

import trio
import trio_asyncio

from meshnode.discovery.mdns import PeerTable, run_mdns
from meshnode.discovery.table import Gone, PeerEntry, Seen, apply, expire
from meshnode.proto import node_pb2 as pb


def test_peer_table_is_changed_only_by_pure_functions():
    e = PeerEntry("mna", "h:1", pb.Capability(), "mdns", 0.0)
    t1 = apply({}, Seen(e), now=100.0)
    assert t1["mna"].last_seen == 100.0
    assert expire(t1, now=120.0, ttl=30.0) == t1
    assert expire(t1, now=131.0, ttl=30.0) == {}
    assert apply(t1, Gone("mna"), now=101.0) == {}
    assert apply(t1, Gone("other"), now=101.0) == t1


async def _wait_for(table: PeerTable, pred) -> None:
    while not pred(table.live()):
        await table.changed.wait()


async def test_nodes_find_each_other_and_a_leaving_node_expires(node_factory):
    extra = ("--mdns", "127.0.0.1")
    a = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=extra))
    b = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=extra))
    table = PeerTable()
    by_endpoint = {a.endpoint: "0:15", b.endpoint: "15:30"}
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_mdns, table, interface="127.0.0.1"))
        with trio.fail_after(30):
            await _wait_for(table, lambda peers: set(by_endpoint) <= {p.endpoint for p in peers.values()})
        found = {p.endpoint: p for p in table.live().values() if p.endpoint in by_endpoint}
        for ep, entry in found.items():
            cap = entry.capability
            assert f"{cap.range.start}:{cap.range.end}" == by_endpoint[ep]
            assert entry.node_id == cap.node_id
            assert entry.source == "mdns"
        gone_id = found[a.endpoint].node_id
        await trio.to_thread.run_sync(a.stop)  # SIGTERM: the node unregisters (mDNS goodbye)
        with trio.fail_after(30):
            await _wait_for(table, lambda peers: gone_id not in peers)
        assert found[b.endpoint].node_id in table.live()
        nursery.cancel_scope.cancel()
