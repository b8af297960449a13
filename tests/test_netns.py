"""Nodes on separate network hosts (bench/netlab.py): Linux network namespaces on a bridge of their own.

Six hosts, each a namespace with one address from 198.18.0.0/15 (torn down after; nothing is routed
outside, the machine's own namespace untouched): a tracker (HTTPS, pinned), a head, a middle hop and a
tail (layers 0:10, 10:20, 20:30), a spare of the middle range, and a client. The nodes listen on their
host's address and advertise it; the client finds them through the tracker and over mDNS on the
bridge, and a generation across three hosts equals the whole model run here. Then the middle hop's link
goes down mid-generation (a partition: its packets vanish, nobody is told): the route fails over to
the spare and the text is still the whole model's; the link comes back and the node rejoins (the
tracker, which had found it dead, finds it alive).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.netlab import Host, Lab, available, lab
from meshnode.runtime.launch import NodeProcess, start_node

why_not = available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no network namespaces here: {why_not}")

PROMPT = "The three primary colors are"
PORT = 7000
LAYERS = {"head": "0:10", "mid": "10:20", "tail": "20:30", "spare": "10:20"}


def _run(host: Host, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*host.exec(), sys.executable, "-m", "meshnode", *args], capture_output=True, text=True,
                          timeout=timeout)


def _status(client: Host, tracker: str) -> dict:
    """The tracker's /api/status, fetched from the client's host over the pinned HTTPS."""
    code = ("import sys, trio; from meshnode.http.client import request, tracker_url; "
            "print(trio.run(request, tracker_url(sys.argv[1], '/api/status'))[1].decode())")
    out = subprocess.run([*client.exec(), sys.executable, "-c", code, tracker], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


@pytest.fixture(scope="module")
def mesh(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, str, dict[str, NodeProcess]]]:
    with lab("tracker", *LAYERS, "client") as net:
        t = net.hosts["tracker"]
        db = tmp_path_factory.mktemp("tracker") / "t.sqlite"
        tracker = subprocess.Popen([*t.exec(), sys.executable, "-m", "tracker", "--listen", f"{t.addr}:8700", "--db",
                                    str(db), "--ttl", "10", "--tls"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert tracker.stdout is not None
        m = re.search(r"status page (https://\S+?)/ .*sha256=([0-9a-f]{64})", tracker.stdout.readline())
        assert m
        url = f"{m.group(1)}#sha256={m.group(2)}"
        nodes: dict[str, NodeProcess] = {}
        errors: list[BaseException] = []

        def start(name: str) -> None:
            h = net.hosts[name]
            try:
                nodes[name] = start_node(model, LAYERS[name], prefix=h.exec(), listen=f"{h.addr}:{PORT}",
                                         extra=("--tracker", url, "--mdns", h.addr, "--heartbeat", "1"))
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=start, args=(name,)) for name in LAYERS]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        try:
            assert not errors, errors
            yield net, url, nodes
        finally:
            for n in nodes.values():
                n.stop()
            tracker.terminate()
            tracker.wait(15)
            tracker.stdout.close()


@pytest.fixture(scope="module")
def whole(model: Path) -> dict:
    """The whole model, run here (the machine's own namespace), greedy."""
    proc = subprocess.run([sys.executable, "-m", "meshnode", "generate", "--model", str(model), "--prompt", PROMPT,
                           "--max-tokens", "160", "--temperature", "0", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_nodes_on_three_hosts_advertise_their_address_and_generate_as_the_whole_model(mesh, whole):
    net, url, nodes = mesh
    client = net.hosts["client"]
    for name, n in nodes.items():
        assert n.endpoint == f"{net.hosts[name].addr}:{PORT}"
    # the tracker lists every node at the address it listens on, and its probes reach each one
    status = _wait(lambda: (s := _status(client, url)) and len(s["nodes"]) == 4 and all(
        (v["probe"] or {}).get("last_ok_seconds_ago") is not None for v in s["nodes"]) and s, 60,
        "the tracker lists and reaches the four nodes")
    assert {v["endpoints"][0] for v in status["nodes"]} == {n.endpoint for n in nodes.values()}
    assert not any(v["insecure"] for v in status["nodes"])
    (model,) = status["models"]
    assert model["covered"]

    for how in (("--tracker", url), ("--mdns", client.addr)):
        proc = _run(client, "generate", "--mesh", model["fingerprint"][:16], *how, "--prompt", PROMPT,
                    "--max-tokens", "24", "--temperature", "0", "--json")
        assert proc.returncode == 0, (how, proc.stderr)
        out = json.loads(proc.stdout)
        assert len(out["route"]) == 3, out["route"]
        assert out["route"][0] == nodes["head"].endpoint
        assert out["route"][1] in (nodes["mid"].endpoint, nodes["spare"].endpoint)
        assert out["route"][2] == nodes["tail"].endpoint
        assert out["tokens"] == whole["tokens"][:24], how


def test_a_partition_fails_over_to_the_spare_and_the_node_rejoins(mesh, whole):
    net, url, nodes = mesh
    client = net.hosts["client"]
    ends = {name: n.endpoint for name, n in nodes.items()}
    mid_id = next(v["node_id"] for v in _status(client, url)["nodes"] if v["endpoints"][0] == ends["mid"])
    cmd = [*client.exec(), sys.executable, "-m", "meshnode", "generate", "--peer", ends["head"], "--peer", ends["mid"],
           "--peer", ends["tail"], "--spare", ends["spare"], "--prompt", PROMPT, "--max-tokens", "160",
           "--temperature", "0", "--step-timeout", "4", "--stream", "--json"]
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    assert gen.stderr is not None
    try:
        for _ in range(8):  # tokens are flowing through the middle hop
            assert "token" in json.loads(gen.stdout.readline())
        net.link("mid", False)  # its packets now go nowhere; neither side is told
        rest = gen.stdout.read()
        assert gen.wait(300) == 0, gen.stderr.read()
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.wait()
        gen.stdout.close()
        gen.stderr.close()
    out = json.loads(rest.strip().splitlines()[-1])
    (f,) = out["failovers"]
    assert (f["hop"], f["layers"], f["replacement"]) == (ends["mid"], "10:20", [ends["spare"]])
    assert "DEADLINE_EXCEEDED" in f["error"]  # noticed by its silence, and blamed on it, not on the head
    assert out["route"] == [ends["head"], ends["spare"], ends["tail"]]
    assert out["tokens"] == whole["tokens"]  # the whole model's text, partition or not

    shown = lambda: next((v for v in _status(client, url)["nodes"] if v["node_id"] == mid_id), None)  # noqa: E731
    _wait(lambda: (v := shown()) is None or not v["alive"], 60, "the tracker finds the cut-off node dead")
    net.link("mid", True)
    back = _wait(lambda: (v := shown()) is not None and v["alive"] and v["liveness_by"] == "probe" and v, 60,
                 "the node rejoins once its link is back")
    assert back["probe"]["failures"] == 0
    # and it serves again: a route through it
    proc = _run(client, "generate", "--peer", ends["head"], "--peer", ends["mid"], "--peer", ends["tail"],
                "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == whole["tokens"][:8]
