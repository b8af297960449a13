"""No single point whose loss stops the mesh, with real processes on hosts of their own (issue 25, item 4).

Ten hosts in network namespaces on a bridge (bench/netlab.py; 198.18.0.0/15, torn down after): three
trackers that sync with each other (``--peer``), six nodes (three replicas of each half of the default
model), each registered with two of the three trackers, and a client. Every tracker comes to list all six. One
tracker is cut off (its link down) while a node leaves; healed, it converges. Then two trackers are
killed, then the third, and the client keeps finding routes: through the tracker left, then through
the nodes' own directories (``--bootstrap``). Every route's text is the whole model's.
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
from meshnode.gguf.model import fingerprint
from meshnode.runtime.launch import NodeProcess, start_node

why_not = available()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no network namespaces here: {why_not}")

PROMPT = "The three primary colors are"
#: each node's range and the two trackers (of three) it registers with: every tracker lists all six only
#: through its peers, and a tracker cut off leaves every node on another
NODES = {"n1": ("0:15", ("t1", "t2")), "n2": ("15:30", ("t2", "t3")), "n3": ("0:15", ("t3", "t1")),
         "n4": ("15:30", ("t1", "t2")), "n5": ("0:15", ("t2", "t3")), "n6": ("15:30", ("t3", "t1"))}
TRACKERS = ("t1", "t2", "t3")


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f}s: {what}")


def _listed(client: Host, url: str, model: str) -> set[str] | None:
    """The endpoints a tracker lists for the model, asked from the client's host (None: no answer)."""
    code = ("import sys, trio, json; from meshnode.http.client import request, tracker_url; "
            "print(trio.run(request, tracker_url(sys.argv[1], '/api/lookup?model=' + sys.argv[2]))[1].decode())")
    out = subprocess.run([*client.exec(), sys.executable, "-c", code, url, model], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        return None
    return {n["endpoints"][0] for n in json.loads(out.stdout)["nodes"]}


def _generate(client: Host, model: str, *how: str) -> dict:
    proc = subprocess.run([*client.exec(), sys.executable, "-m", "meshnode", "generate", "--mesh", model[:16], *how,
                           "--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0", "--json",
                           "--discover-timeout", "10"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (how, proc.stderr[-2000:])
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def net(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, dict, dict]]:
    with lab(*TRACKERS, *NODES, "client") as net:
        urls: dict[str, str] = {}
        trackers: dict[str, subprocess.Popen[str]] = {}
        for t in TRACKERS:  # HTTPS, pinned; each peers with those started before it (a sync goes both ways)
            h = net.hosts[t]
            db = tmp_path_factory.mktemp(t) / "t.sqlite"
            peers = [a for other in urls.values() for a in ("--peer", other)]
            p = subprocess.Popen([*h.exec(), sys.executable, "-m", "tracker", "--listen", f"{h.addr}:8700", "--db",
                                  str(db), "--ttl", "20", "--sync-every", "1", "--tls", *peers],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert p.stdout is not None
            m = re.search(r"status page (https://\S+?)/ .*sha256=([0-9a-f]{64})", p.stdout.readline())
            assert m
            urls[t] = f"{m.group(1)}#sha256={m.group(2)}"
            trackers[t] = p
        nodes: dict[str, NodeProcess] = {}
        errors: list[BaseException] = []

        def start(name: str) -> None:
            h = net.hosts[name]
            layers, ts = NODES[name]
            try:
                nodes[name] = start_node(model, layers, prefix=h.exec(), listen=f"{h.addr}:7000", command="join",
                                         extra=(*[a for t in ts for a in ("--tracker", urls[t])], "--heartbeat", "1"))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=start, args=(n,)) for n in NODES]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        try:
            assert not errors, errors
            yield net, {"urls": urls, "procs": trackers}, nodes
        finally:
            for n in nodes.values():
                n.stop()
            for p in trackers.values():
                if p.poll() is None:
                    p.terminate()
                    p.wait(15)
                if p.stdout:
                    p.stdout.close()


def test_trackers_sync_heal_after_a_partition_and_routes_outlive_every_tracker(net, model: Path, reference) -> None:
    lab_, trk, nodes = net
    client = lab_.hosts["client"]
    fp = fingerprint(model)
    urls, procs = trk["urls"], trk["procs"]
    every = {n.endpoint for n in nodes.values()}
    for t in TRACKERS:  # each node told two trackers: the trackers' sync brings every tracker all six
        _wait(lambda t=t: _listed(client, urls[t], fp) == every, 90, f"{t} lists all six nodes")
    # t3 cut off while n6 leaves: the two others drop it, t3 cannot hear of it; healed, t3 converges
    lab_.link("t3", up=False)
    gone = nodes.pop("n6")
    gone.stop()
    rest = every - {gone.endpoint}
    for t in ("t1", "t2"):
        _wait(lambda t=t: _listed(client, urls[t], fp) == rest, 60, f"{t} drops the node that left")
    lab_.link("t3", up=True)
    _wait(lambda: _listed(client, urls["t3"], fp) == rest, 60, "t3, healed, converges")
    # two trackers killed: a client that knows all three still finds a route
    for t in ("t1", "t2"):
        procs[t].kill()
        procs[t].wait(10)
    got = _generate(client, fp, *[a for t in TRACKERS for a in ("--tracker", urls[t])])
    assert got["tokens"] == reference.tokens[:16]
    # all three killed: the nodes carry the directory; one live node is enough
    procs["t3"].kill()
    procs["t3"].wait(10)
    got = _generate(client, fp, "--bootstrap", nodes["n1"].endpoint)
    assert got["tokens"] == reference.tokens[:16]
    assert set(got["route"]) <= rest
