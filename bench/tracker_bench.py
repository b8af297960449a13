"""A tracker under a flood of fresh keys: ``python -m bench --only tracker``.

A real ``meshnode-tracker`` process on 127.0.0.1 with its default bounds. Lookup and status latency
(median of ``LOOKUPS`` requests, one client connection) and the process's RSS are measured empty and
then full: ``--max-entries`` valid registrations of fresh Ed25519 keys, sent from as many loopback
source addresses as the per-source bounds need (each listed node claims the same model, so every
one of them is a candidate of the lookup), plus the rate at which the tracker verified and stored
them. No node answers the probes, so every entry is unreached: the worst case for the lookup's ranking.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from meshnode.identity import NodeIdentity
from meshnode.identity.advert import advertise
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from tracker.limits import Bounds

LOOKUPS = 50
FP = "ab" * 32


def _registration(i: int) -> bytes:
    me = NodeIdentity.generate()
    now = int(time.time())
    cap = pb.Capability(node_id=me.node_id, model_fingerprint=FP, model_name="flood", n_layer=30,
                        range=pb.LayerRange(start=0, end=30), range_digest="cd" * 32,
                        endpoints=[f"127.3.{i // 250 % 250}.{i % 250 + 1}:9"],
                        attestation=attest(me, fingerprint=FP, start=0, end=30, range_digest="cd" * 32,
                                           llama_build="x", now=now))
    return advertise(me, cap, pb.HealthReply(serving=True), seq=1, now=now).SerializeToString()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _latency(url: str, path: str) -> float:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        times = []
        for _ in range(LOOKUPS):
            t0 = time.perf_counter()
            r = await client.get(url + path)
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def _flood(url: str, bodies: list[bytes], per_source: int) -> float:
    """Seconds to send every registration, ``per_source`` from each loopback source address, 8 at once."""
    limit = trio.CapacityLimiter(8)

    async def one_source(k: int, chunk: list[bytes]) -> None:
        async with limit:
            transport = httpx.AsyncHTTPTransport(local_address=f"127.5.{k // 200}.{k % 200 + 1}")
            async with httpx.AsyncClient(transport=transport, timeout=60, trust_env=False) as client:
                for b in chunk:
                    r = await client.post(url + "/api/register", content=b)
                    if r.status_code != 200:
                        raise RuntimeError(f"registration refused: {r.status_code} {r.text}")

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k in range(0, len(bodies), per_source):
            nursery.start_soon(one_source, k // per_source, bodies[k:k + per_source])
    return time.perf_counter() - t0


def run(model: Path, runs: int, rep: Any) -> dict[str, Any]:
    bounds = Bounds()
    n = bounds.max_entries
    print(f"\n== tracker: lookups empty and with {n} fresh keys listed (its --max-entries)", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshnode-tracker-bench-") as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db",
                                 f"{tmp}/t.sqlite", "--ttl", "600"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout is not None
            m = re.search(r"listening on (\S+)", proc.stdout.readline())
            assert m
            url = f"http://{m.group(1)}"
            lookup = f"/api/lookup?model={FP[:16]}"
            empty = {"lookup_ms": trio.run(_latency, url, lookup), "status_ms": trio.run(_latency, url, "/api/status"),
                     "rss_mib": _rss_mib(proc.pid)}
            bodies = [_registration(i) for i in range(n)]
            # within each source's burst and its bound on nodes: nothing is refused
            seconds = trio.run(_flood, url, bodies, min(bounds.entries_per_source, int(bounds.per_source_burst)))
            full = {"lookup_ms": trio.run(_latency, url, lookup), "status_ms": trio.run(_latency, url, "/api/status"),
                    "rss_mib": _rss_mib(proc.pid), "registrations_per_second": n / seconds}
        finally:
            proc.terminate()
            proc.wait(15)
            if proc.stdout is not None:
                proc.stdout.close()
    print(f"  empty: lookup {empty['lookup_ms']:.1f} ms, status {empty['status_ms']:.1f} ms, RSS "
          f"{empty['rss_mib']:.0f} MiB", flush=True)
    print(f"  {n} listed (registered at {full['registrations_per_second']:.0f}/s): lookup {full['lookup_ms']:.1f} ms "
          f"(answers {min(n, 256)} nodes), status {full['status_ms']:.1f} ms (1,000 nodes), "
          f"RSS {full['rss_mib']:.0f} MiB", flush=True)
    return {"empty": empty, "full": full, "entries": n}
