"""The route against the whole model at the sizes people run: ``python -m bench.sizes`` (issue 23, item 1).

For each model -- the 1.34 GB dense llama (``bench.synth``), a dense llama of at least 4 GB
(``bench.synth --size-gb 4``), the 4.3 GB mixture-of-experts (``bench.synth --arch qwen3moe --size-gb
3``) and SmolLM2-135M as a row -- two ``meshnode serve`` halves at their defaults on this machine, and
``bench.moe_bench.decode_in_turn``: the whole model in ``Llama`` at each thread count and the route
through ``meshnode generate`` (by difference of ``--short`` and ``--long`` tokens), in turn within each
round; per round the ratio to the whole model at its best count, and the median of the rounds' ratios,
with both sides' figures.

``--setting`` picks what is compared (each in turn, round by round):

* ``one-machine`` (default): the halves unpinned at their defaults against the whole model at its best
  thread count, decode through ``meshnode generate``;
* ``pinned``: two machines simulated, each half under ``taskset`` on a core of its own and the initiator
  beside the head, against the whole model on one core, measured just before and just after each route
  run (A B A: the mean of the two);
* ``sessions8``: the same pinned route decoding 8 concurrent sessions (aggregate tok/s, 64 tokens each,
  ``bench.batch_bench``'s initiator) against the whole model batching the 8 on one core.

Reproduce: ``.venv/bin/python -m bench.sizes`` (``--rounds 3``; ``--only NAME`` repeats; ``--setting``;
``--cuts A:B,B:C``; ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def models() -> dict[str, Callable[[], Path]]:
    from bench import synth
    from meshnode.models import pull

    return {
        "dense-1.3GB": lambda: synth.ensure_model(1.0),
        "dense-4GB": lambda: synth.ensure_model(4.0),
        "moe-4.3GB": lambda: synth.ensure_model(3.0, arch="qwen3moe"),
        "smollm2-135M": pull,
    }


SETTINGS = ("one-machine", "pinned", "sessions8")


def cut_list(text: str) -> list[str]:
    """``--cuts``: comma-separated layer ranges, each checked as ``--layers`` checks it."""
    from meshnode.cli.main import parse_layers
    from meshnode.errors import LayerRangeError

    try:
        spans = [parse_layers(c, "--cuts") for c in text.split(",")]
    except LayerRangeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return [f"{a}:{b}" for a, b in spans]


def _summary(rows: list[dict[str, Any]], tokens_equal: bool, compared: int) -> dict[str, Any]:
    return {"rounds": rows, "ratio_median": statistics.median(r["ratio"] for r in rows),
            "whole_tps_median": statistics.median(r["whole_tps"] for r in rows),
            "route_tps_median": statistics.median(r["route_tps"] for r in rows),
            "tokens_equal": tokens_equal, "tokens_compared": compared}


def pinned_in_turn(model: Path, peers: list[str], rounds: int, short: int, long: int) -> dict[str, Any]:
    """One session: the whole model on core 0 (one thread) and the pinned route through ``meshnode
    generate`` on core 0 (by difference), in turn as A B A B ... A: each round's route is set against the
    whole model's runs just before and just after it (the mean of their times a token), so a host that
    drifts steadily across a round weighs on both sides alike; ``rounds + 1`` runs of the whole model."""
    from bench import paths

    paths.generate(peers, paths.PROMPT, 4, cpus=[0])  # warm-up
    rows, route_tokens = [], []
    before = paths.whole_decode(model, 1, long - short, cpus=[0])
    whole_tokens = before["short_tokens"]
    for i in range(rounds):
        ts, s = paths.generate(peers, paths.PROMPT, short, cpus=[0])
        tl, lg = paths.generate(peers, paths.PROMPT, long, cpus=[0])
        after = paths.whole_decode(model, 1, long - short, cpus=[0])
        route, route_tokens = (len(lg["tokens"]) - len(s["tokens"])) / (tl - ts), lg["tokens"]
        whole = 2 / (1 / before["decode_tps"] + 1 / after["decode_tps"])  # the mean time a token, as tok/s
        rows.append({"whole_tps": whole, "whole_before_tps": before["decode_tps"], "whole_after_tps":
                     after["decode_tps"], "route_tps": route, "ratio": route / whole, "hops": lg.get("hops")})
        print(f"  round {i + 1}: whole (Llama, core 0, 1 thread) {before['decode_tps']:.2f} before and "
              f"{after['decode_tps']:.2f} after tok/s; pinned route via `meshnode generate` {route:.2f} tok/s; "
              f"ratio {route / whole:.3f}", flush=True)
        before = after
    n = min(len(route_tokens), len(whole_tokens))
    return _summary(rows, n > 0 and route_tokens[:n] == whole_tokens[:n], n)


def sessions_in_turn(model: Path, peers: list[str], rounds: int, sessions: int = 8, tokens: int = 64) -> dict[str, Any]:
    """``sessions`` concurrent sessions: the whole model batching them on core 0 (one thread), then the
    pinned route (its initiator on core 0), aggregate tok/s, per round.

    Each round also measures the whole model batching ``sessions // 2`` on core 0: two groups of that
    size pipelined over two hops, with no handling cost at all, run at most at 2 x B(S/2) / B(S) of the
    whole model batching S (docs/performance.md, "a model of a token's time"), the route's ceiling here.
    """
    from bench import paths
    from bench.batch_bench import run_route
    from bench.suite import pinned_here

    rows = []
    for i in range(rounds):
        b = paths.whole_batched(model, sessions, 1, tokens, cpus=[0])
        half = paths.whole_batched(model, sessions // 2, 1, tokens, cpus=[0])
        with pinned_here({0}):
            r = run_route(peers, b["ids"], [sessions], tokens, warm=i == 0)["by_n"][str(sessions)]
        route, ceiling = r["tps"], 2 * half["tps"] / b["tps"]
        batches = [round(h["mean_batch"], 2) for h in r["hops"]]
        rows.append({"whole_tps": b["tps"], "whole_half_tps": half["tps"], "route_tps": route,
                     "ratio": route / b["tps"], "ceiling": ceiling, "mean_batch": batches})
        print(f"  round {i + 1}: whole (Llama, core 0, 1 thread) batching {sessions}: {b['tps']:.2f} tok/s, "
              f"batching {sessions // 2}: {half['tps']:.2f} (ceiling of two groups over two hops "
              f"{ceiling:.3f}); pinned route, {sessions} sessions: {route:.2f} tok/s, mean batch per hop "
              f"{batches}; ratio {route / b['tps']:.3f}", flush=True)
    out = _summary(rows, True, 0)
    out["ceiling_median"] = statistics.median(r["ceiling"] for r in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sizes", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=136)
    ap.add_argument("--only", action="append", choices=list(models()), help="this model only (repeat)")
    ap.add_argument("--setting", choices=SETTINGS, default="one-machine")
    ap.add_argument("--cuts", type=cut_list, help="the route's ranges, e.g. 0:13,13:24 (default: the layers halved)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from bench.moe_bench import decode_in_turn
    from meshnode.gguf import ensure_range
    from meshnode.gguf.report import describe
    from meshnode.runtime.launch import local_route

    print(f"command: python -m bench.sizes {' '.join(sys.argv[1:] if argv is None else argv)}")
    from bench.paths import baseline_env

    pages = ("huge pages, as a node's (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)" if "hugetlb=1" in
             baseline_env().get("GLIBC_TUNABLES", "") else "pages as the process starts with")
    print(f"the whole model's weights: read into memory, in {pages}; BENCH_BASELINE_PAGES=small for the latter")
    out: dict[str, Any] = {}
    for name in ns.only or list(models()):
        model = models()[name]()
        d = describe(model)
        n = d["layers"]
        cuts = ns.cuts or [f"0:{n // 2}", f"{n // 2}:{n}"]
        for c in cuts:
            a, b = c.split(":")
            ensure_range(model, int(a), int(b))
        print(f"\n== {name}: {model.name}, {d['size_bytes'] / 1e9:.2f} GB, {n} layers, {d['experts']} experts; "
              f"route {','.join(cuts)}; load average {os.getloadavg()[0]:.2f}", flush=True)
        if ns.setting == "one-machine":
            with local_route(model, cuts) as nodes:
                out[name] = r = decode_in_turn(model, [x.endpoint for x in nodes], ns.rounds, ns.short, ns.long)
        else:
            extra = ["--max-sessions", "8"] if ns.setting == "sessions8" else []
            with local_route(model, cuts, extra=extra, cpus=[[0], [1]]) as nodes:
                peers = [x.endpoint for x in nodes]
                out[name] = r = (pinned_in_turn(model, peers, ns.rounds, ns.short, ns.long) if ns.setting == "pinned"
                                 else sessions_in_turn(model, peers, ns.rounds))
        r["size_gb"] = d["size_bytes"] / 1e9
        print(f"  median of the rounds' ratios {r['ratio_median']:.3f} (route {r['route_tps_median']:.2f} vs whole "
              f"{r['whole_tps_median']:.2f} tok/s)"
              + (f"; tokens equal: {r['tokens_equal']}" if r["tokens_compared"] else "")
              + (f"; ceiling {r['ceiling_median']:.3f}" if "ceiling_median" in r else ""), flush=True)
    print(f"\n| model ({ns.setting}) | size | whole (tok/s) | route (tok/s) | ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        print(f"| {name} | {r['size_gb']:.2f} GB | {r['whole_tps_median']:.2f} | {r['route_tps_median']:.2f} | "
              f"{r['ratio_median']:.3f} |")
    if ns.json:
        print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
