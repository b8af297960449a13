"""A mixture-of-experts model at a realistic size: ``python -m bench.moe_bench`` (issue 22, item 4).

On ``bench.synth --arch qwen3moe --size-gb 3`` (Qwen3-30B-A3B's widths, 64 experts a layer with 8 used,
12 layers, 4.3 GB, the experts ~89% of the bytes; written and cached on first use):

1. **parity** -- a 2-hop route (``0:6``, ``6:12``, two ``meshnode serve`` processes on 127.0.0.1) through
   ``meshnode generate --temperature 0`` gives the whole model's greedy tokens in ``llama_cpp.Llama``;
2. **decode** -- the route through ``meshnode generate`` (by difference of ``--short`` and ``--long``
   tokens, so start-up, session open and prefill cancel out) against the whole model in ``Llama`` at each
   thread count 1..cores, all measured *in turn* within each round (the host drifts by +-20% within
   minutes); per round the ratio route / whole-at-its-best-count, and the median of the rounds' ratios;
3. **memory** -- ``bench.memory_bench`` on the same file: peak RSS of half- and third-range nodes against
   the whole-model process (targets 0.55 and 0.40).

Reproduce: ``.venv/bin/python -m bench.moe_bench`` (``--rounds 3``; ``--no-memory`` skips 3; ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import paths

TARGETS = {"half": 0.55, "third": 0.40}


def route_decode(peers: list[str], short: int, long: int) -> tuple[float, list[int]]:
    """One by-difference measurement through the CLI: (tok/s, the long run's tokens)."""
    ts, s = paths.generate(peers, paths.PROMPT, short)
    tl, lg = paths.generate(peers, paths.PROMPT, long)
    return (len(lg["tokens"]) - len(s["tokens"])) / (tl - ts), lg["tokens"]


def decode_in_turn(model: Path, peers: list[str], rounds: int, short: int, long: int) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    paths.generate(peers, paths.PROMPT, 4)  # warm-up: both nodes' graphs built
    rows = []
    whole_tokens: list[int] = []
    route_tokens: list[int] = []
    for i in range(rounds):
        whole = {}
        for t in range(1, cores + 1):
            w = paths.whole_decode(model, t, long - short)
            whole[t] = w["decode_tps"]
            whole_tokens = w["short_tokens"]
        route, route_tokens = route_decode(peers, short, long)
        best = max(whole, key=lambda t: whole[t])
        rows.append({"whole_by_threads": whole, "best_threads": best, "whole_tps": whole[best], "route_tps": route,
                     "ratio": route / whole[best]})
        print(f"  round {i + 1}: whole (Llama) by threads "
              + ", ".join(f"{t}: {v:.2f}" for t, v in whole.items())
              + f" tok/s; route via `meshnode generate` {route:.2f} tok/s; ratio {route / whole[best]:.3f}",
              flush=True)
    n = min(len(route_tokens), len(whole_tokens))  # both start with the prompt's next token
    return {"rounds": rows, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "whole_tps_median": statistics.median(r["whole_tps"] for r in rows),
            "route_tps_median": statistics.median(r["route_tps"] for r in rows),
            "tokens_equal": n > 0 and route_tokens[:n] == whole_tokens[:n], "tokens_compared": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_bench", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: bench.synth --arch qwen3moe --size-gb 3)")
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds (median of their ratios)")
    ap.add_argument("--short", type=int, default=8, help="tokens of the short generation")
    ap.add_argument("--long", type=int, default=136, help="tokens of the long generation")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ns = ap.parse_args(argv)
    from bench import memory_bench, synth
    from meshnode.gguf import ensure_range
    from meshnode.gguf.report import describe
    from meshnode.runtime.launch import local_route

    model = Path(ns.model) if ns.model else synth.ensure_model(3.0, arch="qwen3moe")
    d = describe(model)
    n = d["layers"]
    cuts = [f"0:{n // 2}", f"{n // 2}:{n}"]
    print(f"command: python -m bench.moe_bench {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"model: {model}: {d['architecture']}, {n} layers, {d['size_bytes'] / 1e9:.2f} GB, {d['experts']} experts "
          f"({d['experts_used']} used), experts {d['expert_bytes'] / d['size_bytes']:.0%} of the bytes; "
          f"cores {len(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for c in cuts:
        a, b = c.split(":")
        ensure_range(model, int(a), int(b))
    out: dict[str, Any] = {"model": str(model), "describe": {k: v for k, v in d.items() if k != "boundaries"}}
    print(f"\n== decode: route {','.join(cuts)} (nodes at their defaults) and the whole model, in turn", flush=True)
    with local_route(model, cuts) as nodes:
        out["decode"] = dec = decode_in_turn(model, [x.endpoint for x in nodes], ns.rounds, ns.short, ns.long)
    print(f"  median of the rounds' ratios: {dec['ratio_median']:.3f} (route {dec['route_tps_median']:.2f} vs whole "
          f"{dec['whole_tps_median']:.2f} tok/s); the route's {dec['tokens_compared']} greedy tokens equal the "
          f"whole model's: {dec['tokens_equal']}", flush=True)
    if not ns.no_memory:
        print("\n== memory (bench.memory_bench on the same file)", flush=True)
        m = memory_bench.run(["--model", str(model), "--no-imports"])
        whole = m["rows"][0]["peak_mb"]
        out["memory"] = m
        for row in m["rows"][1:]:
            kind = row["kind"]
            if kind not in TARGETS:
                continue
            ratio = row["peak_mb"] / whole
            print(f"  {row['process']} {row['layers']}: peak {row['peak_mb']:.0f} MB = {ratio:.3f} x whole "
                  f"({whole:.0f} MB); target <= {TARGETS[kind]}: {'met' if ratio <= TARGETS[kind] else 'NOT met'}",
                  flush=True)
        print(f"  greedy tokens of the halves and thirds equal the whole model's: {m['tokens_equal']}", flush=True)
    if ns.json:
        print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
