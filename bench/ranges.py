"""What each range of a model costs alone: a decode step of each range in ``LlamaRange``, in one process,
the ranges measured in turn round by round (the host drifts): ``python -m bench.ranges`` (issue 23, item 2).

A route's hops should together cost what the whole model costs; this finds the range that does not. A
head runs real token ids, any other range the same fixed residual rows (a middle's or tail's time does
not depend on its input's values). ``--reread`` first drops each range file's pages from the page cache
and reads the file back (the kernel's readahead then fills it with large folios), to tell a range that
is slow from one whose pages happen to sit in small folios (docs/performance.md, "A second host").

    taskset -c 0 python -m bench.ranges --threads 1 --ranges 0:6 6:12 0:12 12:24 0:24 [--reread]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from meshnode.gguf.pages import settle

if TYPE_CHECKING:
    from meshnode.executor._llama import LlamaRange


def step_ms(r: LlamaRange, tokens: int) -> float:
    """Milliseconds a single-token decode step of ``r`` took, over ``tokens`` steps on a fresh KV."""
    r.release(0)
    if r.takes_tokens:
        r.forward(0, 0, tokens=np.arange(1, 9, dtype=np.int32))
    else:
        r.forward(0, 0, embd=np.full((8, r.n_embd), 0.01, np.float32))
    t0 = time.perf_counter()
    for i in range(tokens):
        if r.takes_tokens:
            r.forward(0, 8 + i, tokens=np.array([100 + i % 50], np.int32))
        else:
            r.forward(0, 8 + i, embd=np.full((1, r.n_embd), 0.01, np.float32))
    return (time.perf_counter() - t0) / tokens * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ranges", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the 1.34 GB synthetic model, bench.synth)")
    ap.add_argument("--ranges", nargs="+", default=["0:6", "6:12", "0:12", "12:24", "0:24"], help="A:B ...")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reread", action="store_true", help="sync, drop and re-read each range file's pages first")
    ns = ap.parse_args(argv)
    from bench.paths import huge_pages_here

    huge_pages_here()  # llama.cpp runs in this process: in the pages a node's runs in
    from bench.synth import ensure_model
    from meshnode.executor import openmp

    openmp.configure(ns.threads)  # the node's libgomp spin, before llama.cpp loads
    from meshnode.executor._llama import LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf import ensure_range

    model = Path(ns.model) if ns.model else ensure_model(1.0)
    cfg = ExecConfig(n_ctx_per_session=512, max_sessions=1, n_threads=ns.threads, n_threads_solo=ns.threads,
                     n_threads_batch=ns.threads)
    spans = [tuple(int(x) for x in r.split(":")) for r in ns.ranges]
    ranges = {}
    for a, b in spans:
        art = ensure_range(model, a, b)
        if ns.reread:
            settle(art.range_path)  # what a cut now does itself (meshnode/gguf/pages.py)
        ranges[(a, b)] = LlamaRange(art, cfg)
        ranges[(a, b)].decode_threads = ns.threads
    times: dict[tuple[int, ...], list[float]] = {s: [] for s in ranges}
    for r in ranges.values():
        step_ms(r, 4)
    for k in range(ns.rounds):
        order = list(ranges.items()) if k % 2 == 0 else list(reversed(ranges.items()))
        for s, r in order:
            times[s].append(step_ms(r, ns.tokens))
    print(f"command: python -m bench.ranges {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{model.name}, {ns.threads} thread(s), median of {ns.rounds} rounds of {ns.tokens} steps"
          + (", pages re-read first" if ns.reread else ""))
    print("| range | role | ms a step | rounds |")
    print("|---|---|---|---|")
    for s, r in ranges.items():
        print(f"| {s[0]}:{s[1]} | {r.role} | "
              f"{statistics.median(times[s]):.2f} | {', '.join(f'{t:.1f}' for t in times[s])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
