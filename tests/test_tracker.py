"""The tracker: verified registrations, TTL, SQLite persistence, lookups, the status page."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnode import errors
from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise, verify_advert
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from tests.conftest import PROMPT, cli
from tracker.registry import Entry, Registry
from tracker.views import coverage, mean_batch, node_view

FP = "ab" * 32


def _cap(ident: NodeIdentity, a: int = 0, b: int = 15, now: int | None = None) -> pb.Capability:
    now = int(time.time()) if now is None else now
    return pb.Capability(node_id=ident.node_id, model_fingerprint=FP, model_name="m", n_layer=30,
                         range=pb.LayerRange(start=a, end=b), range_digest="cd" * 32, endpoints=["127.0.0.1:1"],
                         attestation=attest(ident, fingerprint=FP, start=a, end=b, range_digest="cd" * 32,
                                            llama_build="x", now=now))


def test_advert_checks():
    me, other = NodeIdentity.generate(), NodeIdentity.generate()
    now = int(time.time())
    env = advertise(me, _cap(me), pb.HealthReply(), seq=5, now=now)
    assert verify_advert(env, now=now, last_seq=4).seq == 5
    with pytest.raises(errors.AdvertReplayedError):
        verify_advert(env, now=now, last_seq=5)
    with pytest.raises(errors.AttestationExpiredError):
        verify_advert(env, now=now + 3600, last_seq=None)
    stolen = advertise(other, _cap(me), pb.HealthReply(), seq=6, now=now)  # someone else's capability
    with pytest.raises(errors.SignatureError):
        verify_advert(stolen, now=now, last_seq=None)
    lying = _cap(me)
    lying.range.end = 30  # claims more layers than it attested
    with pytest.raises(errors.AttestationMismatchError):
        verify_advert(advertise(me, lying, pb.HealthReply(), seq=7, now=now), now=now, last_seq=None)
    tampered = pb.SignedEnvelope()
    tampered.CopyFrom(env)
    tampered.payload = tampered.payload[:-1] + bytes([tampered.payload[-1] ^ 1])
    with pytest.raises(errors.SignatureError):
        verify_advert(tampered, now=now, last_seq=None)


def test_registry_survives_a_restart_within_ttl_and_expires_after(tmp_path):
    me = NodeIdentity.generate()
    now = time.time()
    env = advertise(me, _cap(me), pb.HealthReply(), seq=1, now=int(now))
    reg = Registry(tmp_path / "t.sqlite", ttl=30)
    reg.register(env, verify_advert(env, now=int(now), last_seq=None), now)
    reg.close()
    reg = Registry(tmp_path / "t.sqlite", ttl=30)
    assert [e.node_id for e in reg.live(now + 10)] == [me.node_id]
    assert reg.last_seq(me.node_id) == 1
    assert reg.live(now + 31) == []
    assert reg.last_seq(me.node_id) == 1  # a replay stays refused after expiry
    reg.close()


def test_node_view_carries_the_heartbeat_headline_figures():
    me = NodeIdentity.generate()
    now = time.time()
    health = pb.HealthReply(serving=False, live_sessions=2, free_sessions=6, steps_total=30, tokens_total=120,
                            errors_total=3, step_seconds_mean=0.012345, detached_sessions=1, batches_total=12)
    env = advertise(me, _cap(me), health, seq=1, now=int(now))
    entry = Entry(me.node_id, env, verify_advert(env, now=int(now), last_seq=None), now, now)
    v = node_view(entry, now, ttl=30)
    assert {k: v[k] for k in ("serving", "live_sessions", "free_sessions", "detached_sessions", "tokens_total",
                              "errors_total", "step_ms_mean", "steps_total", "batches_total", "mean_batch")} == {
        "serving": False, "live_sessions": 2, "free_sessions": 6, "detached_sessions": 1, "tokens_total": 120,
        "errors_total": 3, "step_ms_mean": 12.35, "steps_total": 30, "batches_total": 12, "mean_batch": 2.5}
    assert mean_batch(0, 0) == 0.0  # a node that has not run a step yet


def test_coverage_map():
    nodes = [{"node_id": "a", "range": [0, 2]}, {"node_id": "b", "range": [1, 3]}]
    assert coverage(nodes, 4) == [["a"], ["a", "b"], ["b"], []]


# -- the tracker as a process -------------------------------------------------------------


def _start_tracker(db: Path, ttl: float = 30.0) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db", str(db),
                             "--ttl", str(ttl)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    assert m, line
    return proc, f"http://{m.group(1)}"


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait(pred, timeout: float = 30.0):
    # polling an HTTP API (the tracker has no push); bounded, and each probe is a real request
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.2)


@pytest.fixture
def tracker(tmp_path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    db = tmp_path / "tracker.sqlite"
    proc, url = _start_tracker(db)
    yield proc, url, db
    if proc.poll() is None:
        _stop(proc)


def test_nodes_register_heartbeat_and_leave(tracker, node_factory, tmp_path):
    proc, url, db = tracker
    extra = ("--tracker", url, "--heartbeat", "1")
    head = node_factory("0:15", extra=extra)
    tail = node_factory("15:30", extra=extra)
    status = _wait(lambda: (s := _get(url + "/api/status")) and len(s["nodes"]) == 2 and s)
    (model,) = status["models"]
    assert model["covered"] is True
    assert {tuple(n["range"]) for n in status["nodes"]} == {(0, 15), (15, 30)}
    assert {n["endpoints"][0] for n in status["nodes"]} == {head.endpoint, tail.endpoint}
    assert all(n["alive"] and n["decode_tokens_per_second"] > 0 for n in status["nodes"])
    found = _get(url + "/api/lookup?model=" + model["fingerprint"][:12])
    assert len(found["nodes"]) == 2
    # a replayed registration (a real one, captured from the registry) is refused
    import base64

    env = base64.b64decode(status["nodes"][0]["envelope"])
    code, doc = _post(url + "/api/register", env)
    assert (code, doc["error"]) == (403, "ADVERT_REPLAYED")
    # a forged one: the signature of a real envelope over other bytes
    forged = pb.SignedEnvelope.FromString(env)
    forged.signature = bytes(64)
    code, doc = _post(url + "/api/register", forged.SerializeToString())
    assert (code, doc["error"]) == (403, "SIGNATURE_INVALID")
    code, doc = _post(url + "/api/register", b"garbage")
    assert code == 400
    # a restart of the tracker loses nothing within TTL
    _stop(proc)
    proc2, url2 = _start_tracker(db)
    try:
        assert len(_get(url2 + "/api/status")["nodes"]) == 2
    finally:
        _stop(proc2)


def _rows(dom: str) -> dict[str, dict[str, str]]:
    """Per node row of the rendered page: the text of each cell or span marked ``data-k``."""
    return {m.group(1): dict(re.findall(r'data-k="(\w+)"[^>]*>([^<]*)<', m.group(2)))
            for m in re.finditer(r'<tr data-node="([^"]+)">(.*?)</tr>', dom, re.S)}


HEADLINE = ("tokens_total", "errors_total", "step_ms_mean", "mean_batch", "live_sessions", "free_sessions",
            "detached_sessions")


def test_the_status_page_in_a_real_browser(tracker, node_factory, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is part of the test setup (.ci/install)"
    _, url, _ = tracker
    extra = ("--tracker", url, "--heartbeat", "1")
    head = node_factory("0:15", extra=extra)
    tail = node_factory("15:30", extra=extra)
    _wait(lambda: len(_get(url + "/api/status")["nodes"]) == 2)
    # serve some tokens; the nodes' next heartbeats carry their Health figures to the tracker
    proc = cli("generate", "--peer", head.endpoint, "--peer", tail.endpoint, "--prompt", PROMPT,
               "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    served = len(json.loads(proc.stdout)["prompt_tokens"]) + 7  # the prompt, then one per later token
    status = _wait(lambda: (s := _get(url + "/api/status"))
                   and all(n["tokens_total"] == served for n in s["nodes"]) and s)
    for n in status["nodes"]:
        # one session alone: 8 steps (the prefill, 7 decodes), each its own llama_decode
        assert (n["steps_total"], n["batches_total"], n["mean_batch"]) == (8, 8, 1.0)
        assert n["errors_total"] == 0
        assert n["step_ms_mean"] > 0
        assert (n["live_sessions"], n["free_sessions"], n["detached_sessions"]) == (0, n["max_sessions"], 0)
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=5000"]
    dom = subprocess.run([*args, "--dump-dom", url + "/"], capture_output=True, text=True, timeout=120).stdout
    assert 'data-ready="1"' in dom
    assert "fully covered" in dom
    rows = _rows(dom)
    assert set(rows) == {n["node_id"] for n in status["nodes"]}
    for n in status["nodes"]:
        shown = rows[n["node_id"]]
        assert {k: float(shown[k]) for k in HEADLINE} == {k: float(n[k]) for k in HEADLINE}
        assert int(shown["tokens_total"]) == served > 0
    assert dom.count("class=\"on\"") == 30  # one cell per layer and serving node
    shot = tmp_path / "tracker.png"
    subprocess.run([*args, "--window-size=1760,560", f"--screenshot={shot}", url + "/"],
                   capture_output=True, timeout=120)
    assert shot.exists()
    assert shot.stat().st_size > 10_000
    if os.environ.get("MESHNODE_TRACKER_SCREENSHOT"):  # docs/tracker.md: how docs/tracker.png is made
        shutil.copyfile(shot, os.environ["MESHNODE_TRACKER_SCREENSHOT"])


@pytest.mark.parametrize(("body", "found"), [
    (b"<html>not json</html>", None),
    (b'{"nodes": "all of them"}', None),
    (b'{"nodes": [{"envelope": "%%%"}, {"envelope": "AAAA"}, {"no": "envelope"}, 7]}', 0),
    (b'{"nodes": [{"envelope": "GOOD"}, {"envelope": "AAAA"}]}', 1),
])
async def test_a_garbled_tracker_answer_is_a_typed_error_and_bad_entries_are_skipped(body, found):
    import base64

    import trio
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from meshnode.discovery.tracker_client import lookup
    from meshnode.httpserve import asgi_app, serve_asgi

    good = advertise(me := NodeIdentity.generate(), _cap(me), pb.HealthReply(), seq=1, now=int(time.time()))
    payload = body.replace(b"GOOD", base64.b64encode(good.SerializeToString()))

    async def answer(req: Request) -> Response:
        return Response(payload, media_type="application/json")

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_asgi, asgi_app([Route("/api/lookup", answer)]), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        if found is None:
            with pytest.raises(errors.PeerError, match="not meshnode's JSON"):
                await lookup(url, FP)
        else:
            peers = await lookup(url, FP)
            assert [p.node_id for p in peers] == ([me.node_id] if found else [])
        nursery.cancel_scope.cancel()
