"""A tracker that verifies reports that a hop lied, on real processes over real HTTP.

The tracker runs as its own process with ``--verify-model``; the accused and an honest node register
signed advertisements of the default model; evidence built from a real session (tests/test_evidence.py)
is posted with ``report_evidence``. A confirmed lie marks the node misbehaving in status, on the page and
in lookups (ranked last; the tracker client leaves it out), and a restart keeps the mark; a refuted
report, a tracker without the model, garbage and oversized bodies mark nothing, and the tracker serves on.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnode import errors
from meshnode.audit.evidence import MAX_EVIDENCE_BYTES, sign_evidence
from meshnode.discovery.tracker_client import lookup, report_evidence
from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from tests.test_evidence import CUTS, Run, run  # noqa: F401 (the fixture: one real session, sealed)
from tests.test_tracker import _get, _post, _start_tracker, _stop, _until, browser  # noqa: F401 (a fixture)


def _start(db: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """A tracker process (tests/test_tracker.py's, with flags of our own)."""
    if not extra:
        return _start_tracker(db)
    import re

    proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db", str(db), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on (\S+)", line)
    assert m, line
    return proc, f"http://{m.group(1)}"


def _register(url: str, ident: NodeIdentity, fp: str, a: int, b: int, port: int) -> None:
    now = int(time.time())
    cap = pb.Capability(node_id=ident.node_id, model_fingerprint=fp, model_name="SmolLM2", n_layer=30,
                        range=pb.LayerRange(start=a, end=b), range_digest="cd" * 32,
                        endpoints=[f"127.0.0.1:{port}"],
                        attestation=attest(ident, fingerprint=fp, start=a, end=b, range_digest="cd" * 32,
                                           llama_build="x", now=now))
    code, doc = _post(url + "/api/register", advertise(ident, cap, pb.HealthReply(serving=True),
                                                       seq=time.time_ns(), now=now).SerializeToString())
    assert code == 200, doc


@pytest.fixture
def verifying(tmp_path: Path, model: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    db = tmp_path / "tracker.sqlite"
    proc, url = _start(db, "--verify-model", str(model), "--evidence-rate", "600")
    yield proc, url, db
    if proc.poll() is None:
        _stop(proc)


def _post_raw(url: str, body: bytes) -> int:
    req = urllib.request.Request(url + "/api/evidence", data=body, headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def _announce(url: str, length: int) -> int:
    """The status a POST gets for a body of ``length`` bytes announced and not (yet) sent."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /api/evidence HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/x-protobuf\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode())
        return int(s.recv(4096).split(b" ", 2)[1])


async def test_a_confirmed_lie_marks_the_node_for_good(verifying, run: Run, browser, tmp_path: Path) -> None:  # noqa: F811
    proc, url, db = verifying
    liar, replica = run.idents[1], NodeIdentity.generate()  # the middle hop lies; a replica of its range is honest
    _register(url, liar, run.fp, *CUTS[1], 1)
    _register(url, replica, run.fp, *CUTS[1], 2)
    reporter = NodeIdentity.generate()
    before = await lookup(url, run.fp[:12])
    assert {p.node_id for p in before} == {liar.node_id, replica.node_id}

    honest = await report_evidence(url, sign_evidence(reporter, run.evidence(1, 5)), timeout=300)
    assert honest["verdict"] == "refuted"
    assert not any(n["misbehaving"] for n in _get(url + "/api/status")["nodes"])

    doc = await report_evidence(url, sign_evidence(reporter, run.evidence(1, 3, lie=True)), timeout=300)
    assert (doc["verdict"], doc["pos_start"], doc["accused"], doc["marked"]) == ("confirmed", 12, liar.node_id, True)

    def shown(u: str) -> dict:
        status = _get(u + "/api/status")
        (m,) = status["models"]
        by_id = {n["node_id"]: n for n in status["nodes"]}
        assert by_id[liar.node_id]["misbehaving"] is True
        assert by_id[liar.node_id]["misbehaving_report"]["pos_start"] == 12
        assert by_id[liar.node_id]["misbehaving_report"]["reporter"] == reporter.node_id
        assert by_id[replica.node_id]["misbehaving"] is False
        assert status["nodes"][-1]["node_id"] == liar.node_id  # ranked last
        assert m["misbehaving"] == [liar.node_id]
        assert m["replicas"][10:20] == [1] * 10  # the liar covers nothing
        assert status["misbehaving"]["count"] == 1
        found = _get(u + "/api/lookup?model=" + run.fp[:12])["nodes"]
        assert [(n["node_id"], n["misbehaving"]) for n in found] == [(replica.node_id, False), (liar.node_id, True)]
        return status

    shown(url)
    after = await lookup(url, run.fp[:12])
    assert [p.node_id for p in after] == [replica.node_id]  # the client routes around it

    _stop(proc)  # the mark survives a restart (the registration too, within its TTL)
    proc2, url2 = _start(db)
    try:
        shown(url2)
        br = browser  # the page: the liar's row and badge, and a line in its model's card
        page = await br(br.browser.new_page, viewport={"width": 1280, "height": 800})
        await br(page.goto, url2 + "/")
        seen = await _until(br, page, lambda s: liar.node_id in s["rows"])
        assert seen["rows"][liar.node_id]["row_class"] == "misbehaving"
        assert seen["rows"][liar.node_id]["misbehaving"] == "misbehaving"
        assert "lied at position 12" in seen["rows"][liar.node_id]["lied"]
        assert seen["rows"][replica.node_id]["row_class"] == ""
        assert f"misbehaving: {liar.node_id[:12]} lied at position 12" in seen["text"]
        bars = await br(page.evaluate, """() => Object.fromEntries([...document.querySelectorAll("svg g.row")]
            .map(g => [g.dataset.node, g.dataset.state + " " + g.textContent]))""")  # the map: the liar's bar
        assert bars[liar.node_id].startswith("misbehaving"), bars
        assert bars[replica.node_id].startswith("live"), bars
        await br(page.close)
    finally:
        _stop(proc2)


async def test_without_a_model_nothing_is_verified_or_marked(tmp_path: Path, run: Run) -> None:  # noqa: F811
    proc, url = _start(tmp_path / "tracker.sqlite")
    try:
        _register(url, run.idents[0], run.fp, *CUTS[0], 1)
        with pytest.raises(errors.ModelNotFoundError):
            await report_evidence(url, sign_evidence(NodeIdentity.generate(), run.evidence(0, 2, lie=True)),
                                  timeout=60)
        (node,) = _get(url + "/api/status")["nodes"]
        assert node["misbehaving"] is False
        # reports per source: a burst of 3 (the one above and two more), then 429 before the body is read
        assert [_post_raw(url, b"\xff") for _ in range(2)] == [400] * 2
        assert _post_raw(url, b"\xff") == 429
    finally:
        _stop(proc)


async def test_garbage_forged_and_oversized_evidence_gets_4xx_and_the_tracker_serves_on(verifying,
                                                                                       run: Run) -> None:  # noqa: F811
    proc, url, _ = verifying
    _register(url, run.idents[2], run.fp, *CUTS[2], 1)
    assert _post_raw(url, b"\xff\xfe garbage") == 400
    forged = sign_evidence(NodeIdentity.generate(), run.evidence(2, 3, lie=True))
    forged.signature = bytes(64)
    assert _post_raw(url, forged.SerializeToString()) == 400
    gap = run.evidence(2, 3, lie=True)
    del gap.steps[1]
    with pytest.raises(errors.InputError):  # malformed: checked by the verifier, typed
        await report_evidence(url, sign_evidence(NodeIdentity.generate(), gap), timeout=120)
    assert _announce(url, MAX_EVIDENCE_BYTES + 1) == 413
    assert proc.poll() is None
    assert _get(url + "/healthz") == {"ok": True}
    (node,) = _get(url + "/api/status")["nodes"]
    assert node["misbehaving"] is False


def test_the_tracker_does_not_load_llama_cpp() -> None:
    code = "import sys, tracker.__main__, tracker.evidence; assert 'llama_cpp' not in sys.modules, 'llama_cpp'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_slow_verdict_is_polled_for(tmp_path: Path, model: Path, run: Run,  # noqa: F811
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A verdict not ready within ANSWER_WITHIN is 202 and a poll URL; ``report_evidence`` polls it (in this
    process: the tracker's app with the wait cut to nothing)."""
    import trio

    import tracker.evidence
    from meshnode.http.serve import serve_asgi
    from tracker.app import Tracker
    from tracker.registry import Registry

    monkeypatch.setattr(tracker.evidence, "ANSWER_WITHIN", 0.0)
    registry = Registry(tmp_path / "t.sqlite", ttl=30)
    verifier = tracker.evidence.Verifier(registry, {run.fp: model}, tmp_path / "evidence")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(verifier.serve)
            port = await nursery.start(serve_asgi, Tracker(registry, verifier).asgi(), "127.0.0.1", 0)
            env = sign_evidence(NodeIdentity.generate(), run.evidence(0, 1, lie=True))
            doc = await report_evidence(f"http://127.0.0.1:{port}", env, timeout=300)
            assert (doc["verdict"], doc["pos_start"], doc["marked"]) == ("confirmed", 5, True)
            assert run.idents[0].node_id in registry.marks
            assert not list((tmp_path / "evidence").iterdir())  # the body's file is gone
            nursery.cancel_scope.cancel()
    finally:
        registry.close()


async def test_a_verification_over_its_time_is_killed_and_marks_nothing(tmp_path: Path, model: Path,
                                                                       run: Run) -> None:  # noqa: F811
    """``--verify-timeout``: a child still running at the deadline is killed; the verdict is 503
    DEADLINE_EXCEEDED, nothing is marked, and the same evidence reported again is verified again (a failure
    is not a verdict to answer from memory) (no process starts, loads a model and recomputes a range in
    10 ms)."""
    import trio

    import tracker.evidence
    from tracker.registry import Registry

    registry = Registry(tmp_path / "t.sqlite", ttl=30)
    verifier = tracker.evidence.Verifier(registry, {run.fp: model}, tmp_path / "evidence", timeout=0.01)
    body = sign_evidence(NodeIdentity.generate(), run.evidence(0, 1, lie=True)).SerializeToString()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(verifier.serve)
            status, doc = await verifier.submit(body)
            while status == 202:
                await trio.sleep(0.05)
                status, doc = verifier.result(doc["id"])
            assert (status, doc["verdict"], doc["error"]) == (503, "unverified", "DEADLINE_EXCEEDED"), doc
            assert "--verify-timeout" in doc["message"]
            assert run.idents[0].node_id not in registry.marks
            assert not list((tmp_path / "evidence").iterdir())  # the body's file is gone
            verifier.timeout = 300.0
            status, doc = await verifier.submit(body)
            while status == 202:
                await trio.sleep(0.05)
                status, doc = verifier.result(doc["id"])
            assert (status, doc["verdict"], doc["marked"]) == (200, "confirmed", True), doc
            nursery.cancel_scope.cancel()
    finally:
        registry.close()
