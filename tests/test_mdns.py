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


async def test_a_peer_that_dies_without_goodbye_is_dropped(node_factory):
    node = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=("--mdns", "127.0.0.1")))
    table = PeerTable(ttl=3.0)
    async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_mdns, table, interface="127.0.0.1"))
        with trio.fail_after(30):
            await _wait_for(table, lambda peers: any(p.endpoint == node.endpoint for p in peers.values()))
        node.proc.kill()  # SIGKILL: no mDNS goodbye
        await trio.to_thread.run_sync(node.proc.wait)
        with trio.fail_after(30):
            await _wait_for(table, lambda peers: all(p.endpoint != node.endpoint for p in peers.values()))
        nursery.cancel_scope.cancel()


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


def _generate_mesh(query: str, *extra: str):
    import json
    import subprocess
    import sys

    from tests.conftest import PROMPT

    proc = subprocess.run([sys.executable, "-m", "meshnode", "generate", "--mesh", query, "--mdns", "127.0.0.1",
                           "--prompt", PROMPT, "--max-tokens", "32", "--json", *extra],
                          capture_output=True, text=True, timeout=300)
    return proc, (json.loads(proc.stdout) if proc.returncode == 0 else None)


async def test_generate_finds_its_route_over_mdns_and_avoids_a_node_that_left(node_factory, reference, tmp_path,
                                                                              model):
    import shutil

    # a model of our own (same tensors, another file), so other nodes on this machine cannot interfere
    own = tmp_path / "mesh-model.gguf"
    shutil.copyfile(model, own)
    with own.open("ab") as fh:
        fh.write(b"\0" * 64)
    from meshnode.gguf.model import fingerprint

    fp = fingerprint(own)
    extra = ("--mdns", "127.0.0.1")
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", source=own, extra=extra))
    tail1 = await trio.to_thread.run_sync(lambda: node_factory("15:30", source=own, extra=extra))
    tail2 = await trio.to_thread.run_sync(lambda: node_factory("15:30", source=own, extra=extra))
    proc, out = await trio.to_thread.run_sync(_generate_mesh, fp[:16])
    assert proc.returncode == 0, proc.stderr
    assert out["tokens"] == reference.tokens
    assert out["route"][0] == head.endpoint
    assert out["route"][1] in (tail1.endpoint, tail2.endpoint)
    # the chosen tail leaves; new routes avoid it
    left = tail1 if out["route"][1] == tail1.endpoint else tail2
    stay = tail2 if left is tail1 else tail1
    await trio.to_thread.run_sync(left.stop)
    proc, out = await trio.to_thread.run_sync(_generate_mesh, fp[:16])
    assert proc.returncode == 0, proc.stderr
    assert out["route"] == [head.endpoint, stay.endpoint]
    assert out["tokens"] == reference.tokens
    # without any tail the route has a gap, named
    await trio.to_thread.run_sync(stay.stop)
    proc, _ = await trio.to_thread.run_sync(_generate_mesh, fp[:16], "--discover-timeout", "2")
    assert proc.returncode == 2
    assert "layers 15-29 are not served by any reachable node" in proc.stderr
