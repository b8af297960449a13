"""The directory at scale: ``python -m bench.directory_bench`` (issue 25, item 4).

1. **Simulation** (in process, trio's virtual clock; tests/test_directory.py's): ``--nodes`` (default
   10,000) nodes in models of 100, each registered with one of 3 trackers at random; every ``--period``
   (virtual) seconds each tracker reconciles with the two others by digests (what ``--peer`` trackers do
   over HTTP) and each node takes its model's records from its tracker (its carried directory).
   Printed: the sync periods until every tracker holds every record and every node its model's, the
   bytes of each period, a store's memory (tracemalloc) and record bytes, and how long a lookup of a
   model takes from a store in memory (warm).
2. **Real trackers** (processes on 127.0.0.1): three ``meshnode-tracker`` syncing with each other,
   ``--real`` records registered with the first; two of them then killed, and lookups through
   ``lookup_any`` of all three URLs timed: cold (a new client each: connections, the two dead
   refusing) and warm (the same client's later lookups). p50/p99 of each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def _records(n: int, now: int) -> list:
    from tests.test_directory import _fleet

    return _fleet(n, now, models=max(1, n // 100))  # 100 nodes a model


def simulate(records: list, period: float) -> dict[str, object]:
    import trio
    import trio.testing

    from meshnode.directory.store import RecordStore
    from tests.test_directory import _model_of, _simulate

    now = int(time.time())
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    one = RecordStore()
    for env in records:
        one.offer(env, now)
    store_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    lookups = []
    model = _model_of(records[0])
    for _ in range(100):
        t = time.perf_counter()
        one.live(now, model)
        lookups.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    periods, sent = trio.run(_simulate, records, period, now, clock=trio.testing.MockClock(autojump_threshold=0))
    lookups.sort()
    return {"records": len(records), "periods": periods, "bytes_per_period": sent, "store_memory_bytes": store_bytes,
            "record_bytes": one.bytes_held, "warm_lookup_ms_p50": 1e3 * lookups[50],
            "warm_lookup_ms_p99": 1e3 * lookups[98], "simulated_in_s": time.perf_counter() - t0}


def real(n: int, rounds: int) -> dict[str, object]:
    import re
    import subprocess
    import urllib.request

    import trio

    from meshnode.discovery.tracker_client import lookup_any
    from tests.test_directory import _fleet, _model_of

    def _start(db: Path, *peers: str) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db", str(db),
                                 "--ttl", "600", "--sync-every", "1", "--register-rate", "1000000",
                                 "--max-per-source", "1000000", *[a for p in peers for a in ("--peer", p)]],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        m = re.search(r"listening on (\S+)", proc.stdout.readline())
        assert m
        return proc, f"http://{m.group(1)}"

    def register_all(url: str, envs: list) -> None:
        for env in envs:
            req = urllib.request.Request(url + "/api/register", data=env.SerializeToString(),
                                         headers={"Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()

    with tempfile.TemporaryDirectory() as tmp:
        a = _start(Path(tmp) / "a.sqlite")
        b = _start(Path(tmp) / "b.sqlite", a[1])
        c = _start(Path(tmp) / "c.sqlite", a[1], b[1])
        procs = [a, b, c]
        try:
            now = int(time.time())
            fleet = _fleet(n, now, models=1)  # one model: a lookup answers as many as it may (256)
            MODEL = _model_of(fleet[0])
            register_all(a[1], fleet)
            urls = [a[1], b[1], c[1]]
            deadline = time.monotonic() + 60

            def count(url: str) -> int:
                import json

                with urllib.request.urlopen(url + "/api/status", timeout=10) as r:
                    return int(json.loads(r.read()).get("records") or 0)

            while time.monotonic() < deadline and count(c[1]) < n:
                time.sleep(0.5)
            synced = count(c[1])
            for p, _ in procs[:2]:
                p.terminate()
                p.wait(10)

            async def cold() -> float:
                from meshnode.discovery import tracker_client

                tracker_client._VERIFIED.table.clear()  # as a new client process: nothing verified yet
                t = time.perf_counter()
                await lookup_any(urls, MODEL)
                return time.perf_counter() - t

            colds = sorted(trio.run(cold) for _ in range(rounds))

            async def warm() -> list[float]:
                out = []
                await lookup_any(urls[2:], MODEL)
                for _ in range(rounds):
                    t = time.perf_counter()
                    await lookup_any(urls[2:], MODEL)
                    out.append(time.perf_counter() - t)
                return sorted(out)

            warms = trio.run(warm)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(10)
                if p.stdout:
                    p.stdout.close()

    def pct(xs: list[float], q: float) -> float:
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))]

    return {"records": n, "synced_to_third": synced, "cold_ms_p50": pct(colds, 0.5), "cold_ms_p99": pct(colds, 0.99),
            "warm_ms_p50": pct(warms, 0.5), "warm_ms_p99": pct(warms, 0.99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.directory_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--period", type=float, default=10.0)
    ap.add_argument("--real", type=int, default=200, help="records registered with the real trackers")
    ap.add_argument("--rounds", type=int, default=100, help="lookups timed, cold and warm")
    ns = ap.parse_args(argv)
    print(f"command: python -m bench.directory_bench {' '.join(sys.argv[1:] if argv is None else argv)}", flush=True)
    t0 = time.monotonic()
    records = _records(ns.nodes, int(time.time()))
    print(f"  {ns.nodes} signed records made in {time.monotonic() - t0:.1f} s", flush=True)
    sim = simulate(records, ns.period)
    print(f"simulation: {sim['records']} nodes (100 a model) over 3 trackers: every tracker holds every record and "
          f"every node every record of its model after {sim['periods']} sync period(s) of {ns.period:g} s; bytes "
          f"sent per period (trackers' rounds and the nodes' takes): "
          f"{', '.join(f'{b / 1e6:.2f} MB' for b in sim['bytes_per_period'])}; a store of all the records takes "
          f"{sim['store_memory_bytes'] / 1e6:.1f} MB "
          f"({sim['record_bytes'] / 1e6:.1f} MB of records); a warm lookup of the model from memory "
          f"{sim['warm_lookup_ms_p50']:.2f} ms p50, {sim['warm_lookup_ms_p99']:.2f} ms p99", flush=True)
    r = real(ns.real, ns.rounds)
    print(f"real trackers: {r['records']} records registered with the first, {r['synced_to_third']} held by the "
          f"third (a lookup answers at most 256); with 2 of 3 trackers dead, a lookup through all three URLs: "
          f"cold {r['cold_ms_p50']:.1f} ms p50, "
          f"{r['cold_ms_p99']:.1f} ms p99; warm {r['warm_ms_p50']:.1f} ms p50, {r['warm_ms_p99']:.1f} ms p99",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
