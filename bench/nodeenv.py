"""Routes whose nodes run under different environment variables, in turn with the whole model:
``python -m bench.nodeenv`` (issue 23, item 2: one change at a time, measured against the host's drift).

Each ``--variant NAME[:VAR=VALUE,...]`` is a two-hop route of ``meshnode serve`` halves on this machine
started with those variables (``default`` sets none); every round measures the whole model in ``Llama``
at ``--threads`` and then each route through ``meshnode generate`` (decode by difference of ``--short``
and ``--long`` tokens), the routes' order reversed every other round; per variant the median of the
rounds' ratios to that round's whole model, and each route's profile (compute and own handling per hop,
ms a token) from the long run's ``--json``.

    python -m bench.nodeenv --variant default --variant spin2k:GOMP_SPINCOUNT=2000 --rounds 4
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path


def variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME[:VAR=VALUE,...]`` -> (NAME, {VAR: VALUE})."""
    name, _, rest = text.partition(":")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.isidentifier():
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r} has no name")
    return name, env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nodeenv", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--variant", type=variant, action="append", required=True, help="NAME[:VAR=VALUE,...] (repeat)")
    ap.add_argument("--model", help="GGUF (default: the 1.34 GB synthetic model, bench.synth)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="the whole model's thread count")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=136)
    ns = ap.parse_args(argv)
    from bench import paths
    from bench.synth import ensure_model
    from meshnode.runtime.launch import local_route

    model = Path(ns.model) if ns.model else ensure_model(1.0)
    cuts = paths.halves(model)
    names = [name for name, _ in ns.variant]
    print(f"command: python -m bench.nodeenv {' '.join(sys.argv[1:] if argv is None else argv)}")
    ratios: dict[str, list[float]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        peers = {}
        for name, env in ns.variant:
            peers[name] = [x.endpoint for x in stack.enter_context(local_route(model, cuts, env=env))]
            paths.generate(peers[name], paths.PROMPT, 4)  # warm-up: both graphs built
        for i in range(ns.rounds):
            whole = paths.whole_decode(model, ns.threads, ns.long - ns.short)["decode_tps"]
            line = f"round {i + 1}: whole (Llama, {ns.threads} threads) {whole:.2f} tok/s"
            for name in names if i % 2 == 0 else names[::-1]:
                ts, s = paths.generate(peers[name], paths.PROMPT, ns.short)
                tl, lg = paths.generate(peers[name], paths.PROMPT, ns.long)
                route = (len(lg["tokens"]) - len(s["tokens"])) / (tl - ts)
                ratios[name].append(route / whole)
                hops = " ".join(f"{h['compute_ms']:.1f}+{h['own_ms']:.2f}" for h in lg["hops"]["per_hop"])
                line += f"; {name} {route:.2f} ({route / whole:.3f}; hops compute+own ms {hops})"
            print(line, flush=True)
    for name in names:
        print(f"{name}: median of the rounds' ratios {statistics.median(ratios[name]):.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios[name])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
