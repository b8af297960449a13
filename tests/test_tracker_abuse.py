"""What strangers can make a tracker store and do is bounded (tracker/limits.py; docs/security.md).

The pure decisions first, then a real tracker process flooded over real HTTP
from many loopback source addresses (127.0.0.0/8 is all local on Linux: a
client socket bound to 127.4.1.2 is another source to the tracker), with
valid advertisements signed by thousands of fresh keys, beside one real node.
"""

from __future__ import annotations

import base64
import re
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from tests.conftest import cli
from tracker.limits import Bounds, RateTable, place

PROMPT = "The capital of France is"


# -- the decisions (pure) ------------------------------------------------------------------------


def test_a_source_gets_its_burst_then_its_rate():
    t = RateTable(rate_per_second=2.0, burst=3.0)
    assert [t.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert t.take("a", 0.0) == pytest.approx(0.5)  # empty: the next token in 1/rate s
    assert t.take("b", 0.0) == 0.0  # another source has its own bucket
    assert t.take("a", 0.5) == 0.0  # refilled at the rate
    assert t.take("a", 100.0) == 0.0  # an idle source gets its burst back, never more
    assert [t.take("a", 100.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]


def test_the_table_of_sources_is_bounded():
    t = RateTable(rate_per_second=1.0, burst=1.0, max_keys=100)
    for i in range(1000):
        t.take(f"10.0.{i // 256}.{i % 256}", 0.0)
    assert len(t.buckets) == 100
    assert "10.0.3.231" in t.buckets  # the most recently seen are kept


def test_a_newcomer_is_placed_within_the_bounds():
    b = Bounds(entries_per_source=2, max_entries=3)
    assert place(False, "s", 0, 0, None, b).admit
    assert place(True, "s", 2, 3, None, b).admit  # a listed node's heartbeat: always
    full_here = place(False, "s", 2, 2, None, b)
    assert (full_here.admit, full_here.status) == (False, 429)
    assert "--max-per-source 2" in full_here.why
    displaced = place(False, "s", 1, 3, "old", b)
    assert (displaced.admit, displaced.evict) == (True, "old")
    nobody = place(False, "s", 1, 3, None, b)  # every listed node was reached by a probe
    assert (nobody.admit, nobody.status) == (False, 503)


# -- a real tracker, flooded ---------------------------------------------------------------------

MAX_ENTRIES = 500
PER_SOURCE = 8
FLOOD = 3000


@pytest.fixture
def tracker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    db = tmp_path / "t.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db", str(db),
                             "--ttl", "120", "--max-entries", str(MAX_ENTRIES), "--max-per-source", str(PER_SOURCE)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    m = re.search(r"listening on (\S+)", proc.stdout.readline())
    assert m
    try:
        yield proc, f"http://{m.group(1)}", db
    finally:
        proc.terminate()
        proc.wait(15)
        proc.stdout.close()


def _fake(template: pb.Capability, i: int, seq: int = 1, ident: NodeIdentity | None = None) -> bytes:
    """A valid registration of a fresh key claiming the real node's model and range, at an endpoint nobody
    serves: what a flooder can make for free."""
    me = ident or NodeIdentity.generate()
    now = int(time.time())
    cap = pb.Capability()
    cap.CopyFrom(template)
    cap.node_id = me.node_id
    cap.endpoints[:] = [f"127.3.{i // 250}.{i % 250 + 1}:9"]
    cap.attestation.CopyFrom(attest(me, fingerprint=cap.model_fingerprint, start=cap.range.start,
                                    end=cap.range.end, range_digest=cap.range_digest, llama_build="x", now=now))
    return advertise(me, cap, pb.HealthReply(serving=True), seq=seq, now=now).SerializeToString()


async def _post_all(url: str, source: str, bodies: list[bytes]) -> list[httpx.Response]:
    """Registrations from one source address, one after another on one connection."""
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(transport=transport, timeout=30, trust_env=False) as client:
        return [await client.post(f"{url}/api/register", content=b,
                                  headers={"Content-Type": "application/x-protobuf"}) for b in bodies]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _get(url: str) -> dict:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        r = await client.get(url)
        assert r.status_code == 200, r.text
        return r.json()


async def test_a_flood_of_fresh_keys_is_bounded_and_live_nodes_stay_first(tracker, node_factory):
    proc, url, db = tracker
    real = await trio.to_thread.run_sync(
        lambda: node_factory("0:30", extra=("--tracker", url, "--heartbeat", "1")))
    with trio.fail_after(60):
        while True:  # listed, and reached by the tracker's probes
            nodes = (await _get(f"{url}/api/status"))["nodes"]
            if nodes and (nodes[0]["probe"] or {}).get("last_ok_seconds_ago") is not None:
                break
            await trio.sleep(0.2)
    (shown,) = nodes
    template = pb.Advertisement.FromString(pb.SignedEnvelope.FromString(
        base64.b64decode(shown["envelope"])).payload).capability
    rss_before = _rss_kib(proc.pid)

    # one address may list PER_SOURCE nodes; the next fresh key from it is refused
    here = await _post_all(url, "127.2.0.1", [_fake(template, i) for i in range(PER_SOURCE + 4)])
    assert [r.status_code for r in here] == [200] * PER_SOURCE + [429] * 4
    assert here[-1].json()["error"] == "RESOURCE_EXHAUSTED"
    assert f"--max-per-source {PER_SOURCE}" in here[-1].json()["message"]

    # one address may register a burst, then at its rate: a flood of heartbeats is refused before it is verified
    one = NodeIdentity.generate()
    beats = await _post_all(url, "127.2.0.2", [_fake(template, 1, seq, one) for seq in range(1, 101)])
    codes = [r.status_code for r in beats]
    assert codes[:60] == [200] * 60  # the default burst
    limited = [r for r in beats if r.status_code == 429]
    assert limited, codes
    assert set(codes) == {200, 429}
    assert limited[0].json()["error"] == "RATE_LIMITED"
    assert int(limited[0].headers["Retry-After"]) >= 1

    # thousands of fresh keys from many addresses: the table stays at its bound, the real node in it and first
    sources = [f"127.4.{s // 200}.{s % 200 + 1}" for s in range(FLOOD // PER_SOURCE)]
    got: Counter[int] = Counter()

    async def send(k: int, source: str) -> None:
        rs = await _post_all(url, source, [_fake(template, k * PER_SOURCE + j) for j in range(PER_SOURCE)])
        got.update(r.status_code for r in rs)

    limit = trio.CapacityLimiter(16)

    async def bounded(k: int, source: str) -> None:
        async with limit:
            await send(k, source)

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for k, source in enumerate(sources):
                nursery.start_soon(bounded, k, source)
    assert got == {200: FLOOD}  # each newcomer took the place of one nobody ever reached

    status = await _get(f"{url}/api/status")
    listed = len(status["nodes"]) + status["omitted"]["nodes"]
    assert listed <= MAX_ENTRIES
    assert status["nodes"][0]["node_id"] == shown["node_id"]  # live and reached: first
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        assert con.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] <= MAX_ENTRIES
    lookup = await _get(f"{url}/api/lookup?model={shown['model'][:16]}")
    assert lookup["nodes"][0]["node_id"] == shown["node_id"]
    assert len(lookup["nodes"]) <= 256
    # memory: MAX_ENTRIES entries of a few kB and a bucket per source, whatever the flood's size
    assert _rss_kib(proc.pid) - rss_before < 64 * 1024

    # and the mesh still works through it: a generation finds its route on the flooded tracker
    gen = await trio.to_thread.run_sync(lambda: cli(
        "generate", "--mesh", shown["model"][:16], "--tracker", url, "--prompt", PROMPT, "--max-tokens", "4",
        "--json"))
    assert gen.returncode == 0, gen.stderr
    assert real.endpoint in gen.stdout
