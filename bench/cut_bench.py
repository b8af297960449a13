"""Where to cut: 8 concurrent sessions through two pinned hops, for several cuts, in turn.

    python -m bench.cut_bench [--runs 3] [--cuts 0:15,15:30 --cuts 0:19,19:30 ...]

Two machines simulated as the pinned section of ``python -m bench`` does (head on core 0, tail on core 1,
the initiator on core 0, the whole model batching the same 8 sessions on core 0 with one thread); each
run measures the whole model once, then each cut's route (started fresh, warmed on 16 tokens) on 64
greedy tokens a session, and the medians are printed with their ratio to the whole model. The tail also
runs the lm_head (as much compute as about eight of SmolLM2's layers), so a cut that balances layers
(0:15) does not balance decode compute (0:19 about does): docs/performance.md, "Where to cut".
"""

from __future__ import annotations

import argparse
import statistics

from bench import paths
from bench._setup import model_and_cuts
from bench.batch_bench import run_route
from bench.suite import load, pinned_here
from meshnode.runtime.launch import local_route


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cuts", action="append", help="comma-separated ranges of one route (repeat)")
    ns = ap.parse_args()
    model, _, _ = model_and_cuts(argparse.Namespace(model=None, cuts="0:15,15:30"))
    routes = [c.split(",") for c in (ns.cuts or ["0:15,15:30", "0:19,19:30"])]
    print(f"command: python -m bench.cut_bench --runs {ns.runs}; load average {load()}", flush=True)
    whole: list[float] = []
    tps: dict[str, list[float]] = {",".join(c): [] for c in routes}
    for _ in range(ns.runs):
        b = paths.whole_batched(model, 8, 1, 64, cpus=[0])
        whole.append(b["tps"])
        print(f"  whole model batching 8 on core 0: {b['tps']:.1f} tok/s", flush=True)
        for cut in routes:
            with local_route(model, cut, extra=["--ctx-size", "2560", "--max-sessions", "8"],
                             cpus=[[0], [1]]) as nodes:
                peers = [n.endpoint for n in nodes]
                with pinned_here({0}):
                    run_route(peers, b["ids"], [8], 16, warm=True)
                    t = run_route(peers, b["ids"], [8], 64, warm=False)["by_n"]["8"]["tps"]
            tps[",".join(cut)].append(t)
            print(f"  route {','.join(cut)}: {t:.1f} tok/s", flush=True)
    w = statistics.median(whole)
    print(f"whole model, 8 sessions batched on one core: {w:.1f} tok/s {[round(x, 1) for x in whole]}")
    for cut, v in tps.items():
        m = statistics.median(v)
        print(f"route {cut}: {m:.1f} tok/s {[round(x, 1) for x in v]}, ratio {m / w:.3f} (target >= 1.7)")
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
