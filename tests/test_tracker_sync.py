"""Trackers that sync (``meshnode-tracker --peer``, tracker/peering.py): a record registered with one
tracker is found on the others; a forged one a peer sends is refused; with a tracker gone the others
still sync; the status shows the peers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise
from meshnode.proto import node_pb2 as pb
from tests.conftest import until
from tests.test_tracker import FP, Browser, _cap, _post
from tests.test_tracker import browser as browser  # the fixture

WAIT = 30.0


def _start(db: Path, *peers: str) -> tuple[subprocess.Popen[str], str]:
    args = [a for p in peers for a in ("--peer", p)]
    proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db", str(db),
                             "--ttl", "60", "--sync-every", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    m = re.search(r"listening on (\S+)", proc.stdout.readline())
    assert m
    return proc, f"http://{m.group(1)}"


@pytest.fixture
def trio_of_trackers(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[str], str]]]:
    a = _start(tmp_path / "a.sqlite")
    b = _start(tmp_path / "b.sqlite", a[1])
    c = _start(tmp_path / "c.sqlite", a[1], b[1])
    yield [a, b, c]
    for p, _ in (a, b, c):
        if p.poll() is None:
            p.terminate()
            p.wait(10)
        if p.stdout:
            p.stdout.close()


def _ids(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/api/lookup?model={FP}", timeout=5) as r:
        return {n["node_id"] for n in json.loads(r.read())["nodes"]}


def _until(pred, what: str) -> None:
    until(pred, WAIT, what, every=0.2)


def _register(url: str, me: NodeIdentity, seq: int = 1) -> None:
    code, doc = _post(url + "/api/register", advertise(me, _cap(me), pb.HealthReply(), seq=seq,
                                                       now=int(time.time())).SerializeToString())
    assert code == 200, doc


def test_a_record_registered_with_one_tracker_is_found_on_every_other(trio_of_trackers) -> None:
    (pa, a), (_, b), (_, c) = trio_of_trackers
    nodes = [NodeIdentity.generate() for _ in range(5)]
    for n in nodes[:3]:
        _register(a, n)
    _register(c, nodes[3])
    want = {n.node_id for n in nodes[:4]}
    for url in (a, b, c):
        _until(lambda url=url: _ids(url) >= want, f"{url} holds every record")
    # a forged record sent by a "peer" is refused and listed nowhere
    me, other = nodes[4], NodeIdentity.generate()
    stolen = advertise(other, _cap(me), pb.HealthReply(), seq=9, now=int(time.time()))
    req = urllib.request.Request(b + "/api/sync/records", data=pb.RecordBatch(records=[stolen]).SerializeToString(),
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert json.loads(r.read()) == {"kept": 0, "refused": {"refused": 1}}
    assert me.node_id not in _ids(b)
    with urllib.request.urlopen(f"{b}/api/status", timeout=5) as r:
        assert json.loads(r.read())["refused"].get("foreign_key") == 1  # counted by reason
    # with the first tracker gone, the two others still sync
    pa.terminate()
    pa.wait(10)
    late = NodeIdentity.generate()
    _register(c, late)
    _until(lambda: late.node_id in _ids(b), "b learns from c with a gone")
    with urllib.request.urlopen(f"{c}/api/status", timeout=5) as r:
        status = json.loads(r.read())
    peers = {p["url"]: p for p in status["peers"]}
    assert set(peers) == {a, b}
    assert peers[b]["ok"]
    assert peers[b]["last_sync_seconds_ago"] is not None
    assert not peers[a]["ok"]  # gone: its last error is shown
    assert status["records"] >= 5


def test_sync_endpoints_refuse_bad_bodies(tmp_path: Path) -> None:
    proc, url = _start(tmp_path / "t.sqlite", "http://127.0.0.1:9")  # a peer that is not there
    try:
        bad_hex = json.dumps({"digests": ["zz"] * 256}).encode()
        for path, body in (("digest", b"{}"), ("digest", b"not json"), ("fetch", b'{"ids": 5}'),
                           ("records", b"\xff\xfe garbage"), ("digest", bad_hex)):
            req = urllib.request.Request(f"{url}/api/sync/{path}", data=body)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 400
            e.value.close()
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            assert r.status == 200  # and it keeps serving
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def test_nodes_publish_to_every_tracker_and_clients_need_any_one(model: Path, reference, tmp_path: Path) -> None:
    from meshnode.gguf.model import fingerprint
    from meshnode.runtime.launch import start_node
    from tests.conftest import PROMPT, cli

    (p1, t1), (p2, t2) = _start(tmp_path / "1.sqlite"), _start(tmp_path / "2.sqlite")
    dead = "http://127.0.0.1:9"  # nothing listens there
    trackers = ("--tracker", t1, "--tracker", t2, "--tracker", dead)
    nodes = []
    try:
        nodes = [start_node(model, layers, command="join", extra=(*trackers, "--heartbeat", "1"))
                 for layers in ("0:15", "15:30")]
        fp = fingerprint(model)

        def listed(url: str) -> int:
            with urllib.request.urlopen(f"{url}/api/lookup?model={fp}", timeout=5) as r:
                return len(json.loads(r.read())["nodes"])

        _until(lambda: listed(t1) == 2 and listed(t2) == 2, "both trackers list both nodes")
        p1.terminate()
        p1.wait(10)
        done = cli("generate", "--mesh", fp[:16], "--tracker", dead, "--tracker", t1, "--tracker", t2,
                   "--prompt", PROMPT, "--max-tokens", "8", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tokens"] == reference.tokens[:8]
        p2.terminate()
        p2.wait(10)
        none = cli("generate", "--mesh", fp[:16], "--tracker", t1, "--tracker", t2, "--prompt", PROMPT,
                   "--max-tokens", "8", "--discover-timeout", "2")
        assert none.returncode != 0  # every tracker gone (and no mDNS): nothing to find the mesh with
    finally:
        for n in nodes:
            n.stop()
        for p in (p1, p2):
            if p.poll() is None:
                p.terminate()
                p.wait(10)
            if p.stdout:
                p.stdout.close()


PEERS_SHOWN = """() => Array.from(document.querySelectorAll('#peers tbody tr')).map(r => ({
  url: r.dataset.peer, state: r.querySelector("[data-k='peer_state']").textContent,
  records: r.querySelector("[data-k='their_records']").textContent}))"""


async def test_the_page_shows_the_peers_and_their_state_in_a_real_browser(browser: Browser,
                                                                          tmp_path: Path) -> None:
    a_proc, a = _start(tmp_path / "a.sqlite")
    b_proc, b = _start(tmp_path / "b.sqlite", a)
    try:
        _register(a, NodeIdentity.generate())
        page = await browser(browser.browser.new_page, viewport={"width": 1280, "height": 900})
        await browser(page.goto, b + "/")
        with trio.fail_after(WAIT):
            while True:
                shown = await browser(page.evaluate, PEERS_SHOWN)
                if shown and shown[0]["state"] == "in sync" and shown[0]["records"] == "1":
                    break
                await trio.sleep(0.25)
        assert shown[0]["url"] == a
        a_proc.terminate()
        a_proc.wait(10)
        with trio.fail_after(WAIT):
            while (await browser(page.evaluate, PEERS_SHOWN))[0]["state"] != "unreachable":  # noqa: ASYNC110
                await trio.sleep(0.25)  # (no event crosses from a page)
        text = await browser(page.inner_text, "body")
        assert "1 peer" in text
        await browser(page.close)
    finally:
        for p in (a_proc, b_proc):
            if p.poll() is None:
                p.terminate()
                p.wait(10)
            if p.stdout:
                p.stdout.close()


def test_fuzz_sync_endpoints(tmp_path: Path) -> None:
    """Random and half-valid bodies at every sync endpoint of a live tracker: each answered 200 or 4xx,
    never 5xx nor a dropped connection; then a real registration still works and is found."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    proc, url = _start(tmp_path / "t.sqlite", "http://127.0.0.1:9")
    good = advertise(me := NodeIdentity.generate(), _cap(me), pb.HealthReply(), seq=1, now=int(time.time()))
    bodies = st.one_of(
        st.binary(max_size=3000),
        st.builds(lambda d: json.dumps({"digests": d}).encode(),
                  st.lists(st.one_of(st.text(max_size=40), st.integers(), st.just("00" * 16)), max_size=300)),
        st.builds(lambda ids: json.dumps({"ids": ids}).encode(),
                  st.one_of(st.lists(st.text(max_size=80), max_size=50), st.integers(), st.none())),
        st.builds(lambda envs: pb.RecordBatch(records=envs).SerializeToString(),
                  st.lists(st.one_of(st.just(good), st.builds(pb.SignedEnvelope, payload=st.binary(max_size=200))),
                           max_size=20)),
    )
    seen: list[int] = []
    try:
        @settings(max_examples=120, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(path=st.sampled_from(["digest", "fetch", "records", "nope"]), body=bodies)
        def prop(path: str, body: bytes) -> None:
            req = urllib.request.Request(f"{url}/api/sync/{path}", data=body)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    code = r.status
                    r.read()
            except urllib.error.HTTPError as e:
                code = e.code
                e.close()
            assert code < 500, (path, body[:80], code)
            seen.append(code)

        prop()
        assert 200 in seen
        assert any(400 <= c < 500 for c in seen)
        _register(url, other := NodeIdentity.generate())
        assert other.node_id in _ids(url)
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()
