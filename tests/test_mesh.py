"""The mesh assembles itself: a tracker and node processes on loopback, no --peer flags.

Four nodes join (two replicas of each half of SmolLM2); a generation across the
self-assembled route equals the whole model's greedy tokens; concurrent
sessions spread across the replicas; one node leaves and new routes avoid it;
a node joins with --auto and takes the weakest-covered range.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Iterator

import pytest
import trio
import trio_asyncio

from meshnode.gguf.model import fingerprint
from meshnode.session.mesh import find_route
from tests.conftest import PROMPT, cli
from tests.test_tracker import _start_tracker, _stop


def _status(url: str) -> dict:
    with urllib.request.urlopen(url + "/api/status", timeout=10) as r:
        return json.loads(r.read())


def _wait_nodes(url: str, n: int, timeout: float = 30.0) -> dict:
    # the tracker is polled over HTTP (it has no push); bounded
    deadline = time.monotonic() + timeout
    while True:
        s = _status(url)
        if len(s["nodes"]) == n:
            return s
        assert time.monotonic() < deadline, f"tracker shows {len(s['nodes'])} nodes, want {n}"
        time.sleep(0.2)


@pytest.fixture
def tracker_url(tmp_path) -> Iterator[str]:
    proc, url = _start_tracker(tmp_path / "t.sqlite", ttl=10)
    yield url
    _stop(proc)


async def test_the_mesh_assembles_itself(tmp_path, model, reference, node_factory, tracker_url):
    own = tmp_path / "mesh.gguf"  # our own fingerprint: nothing else on this machine can join this mesh
    shutil.copyfile(model, own)
    with own.open("ab") as fh:
        fh.write(b"\0" * 96)
    fp = fingerprint(own)
    url = tracker_url
    extra = ("--tracker", url, "--heartbeat", "1", "--drain-timeout", "3")

    def join(layers: str | None, *more: str):
        return node_factory(layers, source=own, extra=(*extra, *more), command="join")

    nodes = [await trio.to_thread.run_sync(join, ly) for ly in ("0:15", "15:30", "15:30", "0:15")]
    await trio.to_thread.run_sync(_wait_nodes, url, 4)

    proc = await trio.to_thread.run_sync(lambda: cli("generate", "--mesh", fp[:16], "--tracker", url,
                                                      "--prompt", PROMPT, "--max-tokens", "32", "--json"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == reference.tokens
    assert len(out["route"]) == 2

    # concurrent sessions of one initiator spread across the replicas
    load: dict[str, int] = {}
    tails = []
    async with trio_asyncio.open_loop():
        for _ in range(4):
            route = await find_route(fp[:16], tracker=url, load=load)
            tails.append(route[1])
            for ep in route:
                load[ep] = load.get(ep, 0) + 1
    assert len(set(tails)) == 2

    # one node leaves; new routes avoid it
    leaving = nodes[3]
    proc = await trio.to_thread.run_sync(lambda: cli("leave", "--state-dir", str(leaving.state_dir)))
    assert proc.returncode == 0, proc.stderr
    assert leaving.proc.wait(30) == 0
    status = await trio.to_thread.run_sync(_wait_nodes, url, 3)
    assert leaving.endpoint not in {n["endpoints"][0] for n in status["nodes"]}
    for _ in range(3):
        proc = await trio.to_thread.run_sync(lambda: cli("generate", "--mesh", fp[:16], "--tracker", url,
                                                          "--prompt", PROMPT, "--max-tokens", "8", "--json"))
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert leaving.endpoint not in out["route"]
        assert out["tokens"] == reference.tokens[:8]

    # a node joins with --auto and fills the weakest range (0:15 now has one replica, 15:30 two); its
    # span is given: without one it follows this machine's measured speed against the peers' (unit-tested
    # in test_memcap.py), which a loaded host makes shorter
    auto = await trio.to_thread.run_sync(lambda: join(None, "--auto", "--span", "15"))
    assert auto.layers == "0:15"
    status = await trio.to_thread.run_sync(_wait_nodes, url, 4)
    (m,) = status["models"]
    assert [len(layer) for layer in m["coverage"]] == [2] * 30
