"""Nodes carry the directory (meshnode/directory/carried.py): with the tracker gone, ``generate --mesh
--bootstrap`` finds a whole route from one live node, and a node restarted while every tracker is down
finds its mesh again from what it saved; the Records RPC takes hostile offers and keeps serving."""

from __future__ import annotations

import json
import time
from pathlib import Path

import trio

from meshnode.gguf.model import fingerprint
from meshnode.identity import NodeIdentity
from meshnode.proto import node_pb2 as pb
from meshnode.runtime.launch import NodeProcess, start_node
from meshnode.transport.aiothread import open_aio_thread
from meshnode.transport.client import records
from tests.conftest import PROMPT, cli, until
from tests.test_directory import _record
from tests.test_tracker import _start_tracker, _stop

WAIT = 60.0


def _held(endpoint: str, model: str = "") -> list[pb.SignedEnvelope]:
    async def main() -> list[pb.SignedEnvelope]:
        async with open_aio_thread() as aio:
            got: pb.RecordBatch = await aio.run(records, endpoint, pb.RecordsRequest(model=model))
            return list(got.records)

    return trio.run(main)


def _ids(envs: list[pb.SignedEnvelope]) -> set[str]:
    return {pb.Advertisement.FromString(e.payload).capability.node_id for e in envs}


def _until(pred, what: str) -> None:
    until(pred, WAIT, what, every=0.3)


def _node_id(state: Path) -> str:
    return json.loads((state / "node.json").read_text())["node_id"]


def test_the_mesh_is_found_through_its_nodes_with_every_tracker_down(model: Path, reference, tmp_path: Path) -> None:
    proc, url = _start_tracker(tmp_path / "t.sqlite", ttl=30)
    fp = fingerprint(model)
    flags = ("--tracker", url, "--heartbeat", "1")
    states = [tmp_path / f"s{i}" for i in range(3)]
    nodes: list[NodeProcess] = []
    try:
        for layers, state in zip(("0:15", "15:30", "0:15"), states, strict=True):
            state.mkdir()
            nodes.append(start_node(model, layers, command="join", state_dir=state, extra=flags))
        ids = {_node_id(st) for st in states}
        for n in nodes:  # every node learns every other: from the tracker, and from each other
            _until(lambda n=n: _ids(_held(n.endpoint, fp)) >= ids, f"{n.endpoint} holds every record")
        _stop(proc)  # every tracker gone
        done = cli("generate", "--mesh", fp[:16], "--bootstrap", nodes[2].endpoint, "--prompt", PROMPT,
                   "--max-tokens", "8", "--json")
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert got["tokens"] == reference.tokens[:8]
        assert set(got["route"]) <= {n.endpoint for n in nodes}
        # a node restarted while every tracker is down finds its mesh again from what it saved
        tail = nodes.pop(1)
        listen = tail.endpoint
        tail.stop()
        assert (states[1] / "directory.pb").exists()
        back = start_node(model, "15:30", command="join", state_dir=states[1], listen=listen, extra=flags)
        nodes.append(back)
        others = ids - {_node_id(states[1])}
        _until(lambda: _ids(_held(back.endpoint, fp)) >= others, "the restarted node knows the others")
        _until(lambda: _node_id(states[1]) in _ids(_held(nodes[0].endpoint, fp)), "and they know it is back")
        again = cli("generate", "--mesh", fp[:16], "--bootstrap", back.endpoint, "--prompt", PROMPT,
                    "--max-tokens", "8", "--json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["tokens"] == reference.tokens[:8]
    finally:
        for n in nodes:
            n.stop()
        if proc.poll() is None:
            _stop(proc)


def test_records_takes_hostile_offers_checked_and_keeps_serving(model: Path, node_factory, reference) -> None:
    head, tail = node_factory("0:15"), node_factory("15:30")
    now = int(time.time())
    forged = _record(NodeIdentity.generate(), now, 1)
    forged.signature = bytes(64)
    expired = _record(NodeIdentity.generate(), now - 600, 1, ttl=60)
    good = _record(stranger := NodeIdentity.generate(), now, 1)
    junk = [pb.SignedEnvelope(payload=b"\xff" * 100, payload_type="meshnode.v1.Advertisement")] * 200

    async def offer() -> list[pb.SignedEnvelope]:
        async with open_aio_thread() as aio:
            req = pb.RecordsRequest(offer=pb.RecordBatch(records=[forged, expired, good, *junk]))
            got: pb.RecordBatch = await aio.run(records, head.endpoint, req)
            return list(got.records)

    held = _ids(trio.run(offer))
    assert stranger.node_id in held  # a well-signed record of another node (a stranger's model) is kept
    assert not held & {pb.Advertisement.FromString(e.payload).capability.node_id for e in (forged, expired)}
    done = cli("generate", "--peer", head.endpoint, "--peer", tail.endpoint, "--prompt", PROMPT, "--max-tokens", "8",
               "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tokens"] == reference.tokens[:8]
