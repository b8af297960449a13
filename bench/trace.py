"""Where a decode token's time goes outside llama.cpp, step by step, across the processes of a route on one
machine: ``python -m bench.trace`` (issue 23, item 2).

It needs timestamps the product does not take: apply ``bench/trace.patch`` to a checkout first (it adds
calls at ~20 points of a step's path, and ``meshnode/_trace.py``, which writes them when
``MESHNODE_TRACE`` is set), run this, then revert the patch. The clock is CLOCK_MONOTONIC, which every
process of one machine shares, so the head's and the tail's stamps line up on one time axis. Prints, for
the last two thirds of the decoded tokens, the median time between consecutive stamps (``H:`` the head,
``T:`` the tail), largest total first.

    git apply bench/trace.patch
    python -m bench.trace [--model GGUF] [--tokens 136] [--pinned]
    git apply -R bench/trace.patch
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import statistics
import tempfile
from pathlib import Path


def lines_up(files: list[str]) -> list[tuple[str, str, float, int]]:
    """(from, to, median µs, count) between consecutive stamps of the steady two thirds, largest total first."""
    rows = []
    for f in files:
        for line in Path(f).read_text().splitlines():
            t, pid, _, name = line.split()
            rows.append((int(t), int(pid), name))
    rows.sort()
    heads = {pid for _, pid, name in rows if name == "generate_step"}
    seq = [(t, ("H:" if pid in heads else "T:") + name) for t, pid, name in rows]
    seq = seq[len(seq) // 3 :]
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for (t0, a), (t1, b) in itertools.pairwise(seq):
        gaps[(a, b)].append((t1 - t0) / 1e3)
    out = [(a, b, statistics.median(v), len(v)) for (a, b), v in gaps.items()]
    return sorted(out, key=lambda r: -r[2] * r[3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trace", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the 1.34 GB synthetic model, bench.synth)")
    ap.add_argument("--tokens", type=int, default=136)
    ap.add_argument("--pinned", action="store_true", help="a core each (head and initiator on 0, tail on 1)")
    ns = ap.parse_args(argv)
    from bench import paths
    from bench.synth import ensure_model
    from meshnode.runtime.launch import local_route

    if not Path(__file__).resolve().parents[1].joinpath("meshnode", "_trace.py").exists():
        raise SystemExit("apply bench/trace.patch first (git apply bench/trace.patch)")
    model = Path(ns.model) if ns.model else ensure_model(1.0)
    cpus = [[0], [1]] if ns.pinned else []
    with tempfile.TemporaryDirectory(prefix="meshnode-trace-") as d:
        prefix = os.path.join(d, "t")
        with local_route(model, paths.halves(model), cpus=cpus, env={"MESHNODE_TRACE": prefix}) as nodes:
            peers = [x.endpoint for x in nodes]
            _, result = paths.generate(peers, paths.PROMPT, ns.tokens, cpus=[0] if ns.pinned else None)
        rows = lines_up(glob.glob(prefix + ".*"))
    print(json.dumps(result.get("hops"), indent=1))
    print(f"{'from':>20} -> {'to':<20} {'median µs':>10} {'count':>6}")
    for a, b, med, count in rows:
        if count >= 10:
            print(f"{a:>20} -> {b:<20} {med:10.1f} {count:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
