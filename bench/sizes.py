"""The route against the whole model at the sizes people run: ``python -m bench.sizes`` (issue 23, item 1).

For each model -- the 1.34 GB dense llama (``bench.synth``), a dense llama of at least 4 GB
(``bench.synth --size-gb 4``), the 4.3 GB mixture-of-experts (``bench.synth --arch qwen3moe --size-gb
3``) and SmolLM2-135M as a row -- two ``meshnode serve`` halves at their defaults on this machine, and
``bench.moe_bench.decode_in_turn``: the whole model in ``Llama`` at each thread count and the route
through ``meshnode generate`` (by difference of ``--short`` and ``--long`` tokens), in turn within each
round; per round the ratio to the whole model at its best count, and the median of the rounds' ratios,
with both sides' figures.

Reproduce: ``.venv/bin/python -m bench.sizes`` (``--rounds 3``; ``--only NAME`` repeats; ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sizes", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=136)
    ap.add_argument("--only", action="append", choices=list(models()), help="this model only (repeat)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from bench.moe_bench import decode_in_turn
    from meshnode.gguf import ensure_range
    from meshnode.gguf.report import describe
    from meshnode.runtime.launch import local_route

    print(f"command: python -m bench.sizes {' '.join(sys.argv[1:] if argv is None else argv)}")
    out: dict[str, Any] = {}
    for name in ns.only or list(models()):
        model = models()[name]()
        d = describe(model)
        n = d["layers"]
        cuts = [f"0:{n // 2}", f"{n // 2}:{n}"]
        for c in cuts:
            a, b = c.split(":")
            ensure_range(model, int(a), int(b))
        print(f"\n== {name}: {model.name}, {d['size_bytes'] / 1e9:.2f} GB, {n} layers, {d['experts']} experts; "
              f"route {','.join(cuts)}; load average {os.getloadavg()[0]:.2f}", flush=True)
        with local_route(model, cuts) as nodes:
            out[name] = r = decode_in_turn(model, [x.endpoint for x in nodes], ns.rounds, ns.short, ns.long)
        r["size_gb"] = d["size_bytes"] / 1e9
        print(f"  median of the rounds' ratios {r['ratio_median']:.3f} (route {r['route_tps_median']:.2f} vs whole "
              f"{r['whole_tps_median']:.2f} tok/s); tokens equal: {r['tokens_equal']}", flush=True)
    print("\n| model | size | whole, best count (tok/s) | route via `meshnode generate` (tok/s) "
          "| ratio (median of rounds) |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        print(f"| {name} | {r['size_gb']:.2f} GB | {r['whole_tps_median']:.2f} | {r['route_tps_median']:.2f} | "
              f"{r['ratio_median']:.3f} |")
    if ns.json:
        print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
