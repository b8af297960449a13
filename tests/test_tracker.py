"""The tracker: verified registrations, TTL, SQLite persistence, lookups, the status page."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import trio

from meshnode import errors
from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise, verify_advert
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from tests.conftest import initiator
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


HEADLINE = ("tokens_total", "errors_total", "step_ms_mean", "mean_batch", "live_sessions", "free_sessions",
            "detached_sessions")
#: nouns the page counts; "1 nodes" or "2 node" would be wrong
COUNTED = ("model", "node", "live node", "layer", "active session", "core")
WIDTH = 1280


SHOWN = """() => ({
    rows: Object.fromEntries([...document.querySelectorAll("#nodes tbody tr")].map(tr => [tr.dataset.node,
        Object.assign({row_class: tr.className},
            Object.fromEntries([...tr.querySelectorAll("[data-k]")].map(e => [e.dataset.k, e.textContent])))])),
    models: [...document.querySelectorAll(".model")].map(m => ({
        coverage: m.querySelector("[data-k=coverage]").textContent,
        sessions: m.querySelector("[data-k=active_sessions]").textContent,
        on: m.querySelectorAll("td.on").length, lost: m.querySelectorAll("td.lost").length})),
    refreshes: Number(document.body.dataset.refreshes || 0),
    text: document.body.innerText})"""
HEADERS = """() => [...document.querySelectorAll("#nodes th")].map(th => {
    const r = th.getBoundingClientRect(); return [th.textContent.trim(), r.left, r.right]; })"""


class Browser:
    """Playwright's sync API on a thread of its own: trio's thread neither blocks on it nor shares its
    asyncio loop (playwright marks its loop as running between calls)."""

    def __init__(self, pool: ThreadPoolExecutor, browser: Any) -> None:
        self.pool, self.browser = pool, browser

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        future = self.pool.submit(fn, *args, **kwargs)
        return await trio.to_thread.run_sync(future.result)


@pytest.fixture
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is part of the test setup (.ci/install)"

    def start() -> tuple[Any, Any]:
        policy = asyncio.get_event_loop_policy()  # trio-asyncio's, once imported: it makes trio loops
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        try:
            pw = sync_playwright().start()
        finally:
            asyncio.set_event_loop_policy(policy)
        return pw, pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])

    pool = ThreadPoolExecutor(1, thread_name_prefix="playwright")
    try:
        pw, b = pool.submit(start).result(timeout=120)
        try:
            yield Browser(pool, b)
        finally:
            pool.submit(lambda: (b.close(), pw.stop())).result(timeout=60)
    finally:
        pool.shutdown()


async def _status_until(url: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 30.0) -> dict[str, Any]:
    """Poll /api/status until ``pred`` holds; bounded."""
    with trio.fail_after(timeout):
        while not pred(status := await trio.to_thread.run_sync(_get, url + "/api/status")):  # noqa: ASYNC110
            await trio.sleep(0.2)
    return status


async def _until(br: Browser, page: Any, pred: Callable[[dict[str, Any]], bool],
                 timeout: float = 30.0) -> dict[str, Any]:
    """Poll what the page shows (it refreshes itself every second) until ``pred`` holds; bounded.
    Per node row: its ``data-k`` figures and the row's class; per model: its coverage words, active
    sessions and coverage cells; and the body text."""
    with trio.fail_after(timeout):
        while not pred(shown := await br(page.evaluate, SHOWN)):  # noqa: ASYNC110 (no event crosses from a page)
            await trio.sleep(0.25)
    return shown


def _plurals_right(text: str) -> None:
    for noun in COUNTED:
        assert not re.search(rf"\b1 {noun}s\b", text), f"'1 {noun}s' on the page"
        assert not re.search(rf"\b(0|[2-9]|\d\d+) {noun}\b(?!s)", text), f"plural of {noun!r} missing"


async def _layout_fits(br: Browser, page: Any) -> None:
    """Every column header of the node table inside the 1280 px viewport, nothing scrolls sideways."""
    boxes = await br(page.evaluate, HEADERS)
    assert len(boxes) == 12
    for name, left, right in boxes:
        assert left >= 0, f"column {name!r} starts at {left:.0f} px"
        assert right <= WIDTH, f"column {name!r} ends at {right:.0f} px, beyond {WIDTH}"
    scroll, client = await br(page.evaluate, "[document.documentElement.scrollWidth, "
                                             "document.documentElement.clientWidth]")
    assert scroll <= client


async def _screenshot(br: Browser, page: Any, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    await br(page.screenshot, path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("MESHNODE_TRACKER_SCREENSHOTS"):  # docs/tracker.md: how docs/tracker*.png are made
        shutil.copyfile(shot, Path(os.environ["MESHNODE_TRACKER_SCREENSHOTS"]) / name)


async def test_the_status_page_tells_the_truth_in_a_real_browser(tracker, node_factory, browser, tmp_path):
    """Both nodes alive and the model covered; live counters during a session; a SIGKILLed node dead
    and its layers uncovered within seconds (long before its TTL); every column inside 1280 px."""
    _, url, _ = tracker
    extra = ("--tracker", url)  # the default heartbeat (10 s): what is fresh on the page comes from the probes
    head = node_factory("0:15", extra=extra)
    tail = node_factory("15:30", extra=extra)
    registered = await _status_until(url, lambda s: len(s["nodes"]) == 2)
    ids = {n["endpoints"][0]: n["node_id"] for n in registered["nodes"]}
    br = browser
    page = await br(br.browser.new_page, viewport={"width": WIDTH, "height": 800})
    await br(page.goto, url + "/")
    shown = await _until(br, page, lambda s: len(s["rows"]) == 2 and all(
        r["liveness"] == "alive" for r in s["rows"].values()) and s["models"][0]["coverage"] == "fully covered")
    assert shown["models"][0]["on"] == 30  # one cell per layer and serving node
    _plurals_right(shown["text"])
    await _layout_fits(br, page)

    # a session: each hop's counters reach the page while it runs (the heartbeats are 10 s apart)
    gen = [sys.executable, "-m", "meshnode", "generate", "--peer", head.endpoint, "--peer", tail.endpoint,
           "--prompt", "Once upon a time, a young dragon", "--max-tokens", "1500", "--temperature", "0.8",
           "--seed", "3", "--json"]  # a story opening: this seed runs to the length (an instruction may end at once)
    async with initiator(gen, timeout=300) as run:
        shown = await _until(br, page, lambda s: all(float(s["rows"][ids[n.endpoint]].get("tokens_total", 0)) > 0
                                                 and float(s["rows"][ids[n.endpoint]].get("step_ms_mean", 0)) > 0
                                                 for n in (head, tail)), timeout=60)
        assert run.proc.returncode is None, "the session ended before the page showed its counters"
        assert shown["models"][0]["sessions"] == "1 active session"
        _plurals_right(shown["text"])
        await _screenshot(br, page, tmp_path, "tracker.png")
    assert run.proc.returncode == 0, run.text()
    result = json.loads(run.stdout)
    served = len(result["prompt_tokens"]) + len(result["tokens"]) - 1  # the prompt, then one per later token
    status = await _status_until(url, lambda s: all(n["tokens_total"] == served and n["live_sessions"] == 0
                                                    for n in s["nodes"]))
    for n in status["nodes"]:
        # one session alone: a step per token (the prefill, then the decodes), each its own llama_decode
        assert (n["steps_total"], n["batches_total"], n["mean_batch"]) == (len(result["tokens"]),) * 2 + (1.0,)
        assert n["errors_total"] == 0
        assert n["step_ms_mean"] > 0
        assert (n["live_sessions"], n["free_sessions"], n["detached_sessions"]) == (0, n["max_sessions"], 0)
    # the page shows the same figures once a probe after the session's close reached it (a probe between
    # the last step and the close shows every token and the session still live)
    shown = await _until(br, page, lambda s: all(r.get("tokens_total") == str(served) and r.get("live_sessions") == "0"
                                                 for r in s["rows"].values()))
    for n in status["nodes"]:
        row = shown["rows"][n["node_id"]]
        assert {k: float(row[k]) for k in HEADLINE} == {k: float(n[k]) for k in HEADLINE}
    assert shown["models"][0]["sessions"] == "0 active sessions"

    # SIGKILL the tail: no goodbye, no more heartbeats; the probes notice
    tail.proc.kill()
    tail.proc.wait()
    dead = ids[tail.endpoint]
    shown = await _until(br, page, lambda s: s["rows"][dead]["liveness"] == "dead"
                         and s["models"][0]["coverage"] == "not covered", timeout=20)
    assert shown["rows"][dead]["row_class"] == "dead"
    assert shown["rows"][ids[head.endpoint]]["liveness"] == "alive"
    assert (shown["models"][0]["on"], shown["models"][0]["lost"]) == (15, 15)
    assert "layers 15\u201329 served by no live node" in shown["text"]
    assert "2 nodes (1 dead)" in shown["text"]
    assert "1 live node (+1 dead)" in shown["text"]
    _plurals_right(shown["text"])
    status = _get(url + "/api/status")
    (gone,) = [n for n in status["nodes"] if n["node_id"] == dead]
    assert gone["liveness_by"] == "probe"
    assert gone["last_seen_seconds_ago"] < 30  # dead by the probes, not by the TTL
    (model,) = status["models"]
    assert (model["covered"], model["gaps"]) == (False, [[15, 30]])
    found = _get(url + "/api/lookup?model=" + model["fingerprint"][:12])
    assert [n["node_id"] for n in found["nodes"]] == [ids[head.endpoint]]  # routes are built from live nodes
    await _until(br, page, lambda s: s["refreshes"] >= shown["refreshes"] + 1)  # the dead row fully drawn
    await _layout_fits(br, page)
    await _screenshot(br, page, tmp_path, "tracker-dead.png")
    await br(page.close)


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
    from meshnode.http.serve import asgi_app, serve_asgi

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


async def test_hostile_advertised_text_stays_text_and_the_page_still_fits(tracker, browser):
    """A node's claims (endpoint, CPU, model name) are shown escaped and cut to fit 1280 px."""
    _, url, _ = tracker
    me = NodeIdentity.generate()
    cap = _cap(me)
    del cap.endpoints[:]
    cap.endpoints.append("h" * 300 + ":7001")
    cap.model_name = "<img src=x onerror=\"document.body.dataset.owned='1'\">" + "M" * 200
    cap.hardware.cpu_model = "<script>document.body.dataset.owned='1'</script>" + " very long cpu" * 30
    code, doc = _post(url + "/api/register", advertise(me, cap, pb.HealthReply(), seq=1,
                                                        now=int(time.time())).SerializeToString())
    assert (code, doc["ok"]) == (200, True)
    br = browser
    page = await br(br.browser.new_page, viewport={"width": WIDTH, "height": 800})
    await br(page.goto, url + "/")
    shown = await _until(br, page, lambda s: me.node_id in s["rows"])
    assert "<script>document.body" in shown["text"]  # shown as text, not run
    assert await br(page.evaluate, "document.body.dataset.owned") is None
    await _layout_fits(br, page)
    await br(page.close)
