"""What a batch of decode steps costs in llama.cpp by the KV sequences it holds: ``python -m bench.seqruns``.

A node keeps each session's KV cache apart (``kv_unified = false``: a sequence per slot), and llama.cpp
cuts a batch over such a cache into micro-batches of *consecutive* sequence ids, so a batch of slots
0, 2, 4 and 6 runs as four passes over the weights where slots 0 to 3 run as one. This times one range
(``LlamaRange``, the node's executor, one thread by default: run it under ``taskset`` for a core of its
own) decoding a step for each of the given slots, the sets in turn (A, B, B, A by round), and prints the
median milliseconds a batch (docs/performance.md, "8 sessions: groups of consecutive slots").

    taskset -c 1 python -m bench.seqruns [--model GGUF] [--range 12:24] [--seqs 0,1,2,3 --seqs 0,2,4,6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _seqs(text: str) -> list[int]:
    try:
        seqs = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of slots") from None
    if not seqs or len(set(seqs)) != len(seqs) or min(seqs) < 0 or max(seqs) > 63:
        raise argparse.ArgumentTypeError(f"{text!r}: distinct slots from 0 to 63")
    return seqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.seqruns", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", type=Path, help="a GGUF (default: the 1.34 GB synthetic llama of bench.synth)")
    ap.add_argument("--range", default="", help="START:END of the model's layers (default: the second half)")
    ap.add_argument("--seqs", type=_seqs, action="append",
                    help="slots of one batch (repeat; default: 0,1,2,3 and 0,2,4,6)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="batches timed a round")
    ap.add_argument("--threads", type=int, default=1)
    ns = ap.parse_args(argv)
    from bench.paths import huge_pages_here

    huge_pages_here()  # llama.cpp runs in this process: in the pages a node's runs in
    from bench import synth
    from meshnode.executor._bindings import silence_llama_logs
    from meshnode.executor._llama import Chunk, LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf import ensure_range
    from meshnode.gguf.report import describe

    silence_llama_logs()
    model = ns.model or synth.ensure_model(1.0)
    n_layer = describe(model)["layers"]
    start, end = (int(x) for x in ns.range.split(":")) if ns.range else (n_layer // 2, n_layer)
    sets = ns.seqs or [[0, 1, 2, 3], [0, 2, 4, 6]]
    slots = max(max(s) for s in sets) + 1
    r = LlamaRange(ensure_range(model, start, end),
                   ExecConfig(max_sessions=slots, n_threads=ns.threads, n_threads_solo=ns.threads,
                              n_threads_batch=ns.threads))
    r.decode_threads = ns.threads
    rng = np.random.default_rng(0)
    times: dict[int, list[float]] = {i: [] for i in range(len(sets))}

    def batch(seqs: list[int]) -> float:
        if r.takes_tokens:
            chunks = [Chunk(s, r.next_pos(s), tokens=np.asarray([1 + s], np.int32)) for s in seqs]
        else:
            chunks = [Chunk(s, r.next_pos(s), embd=rng.standard_normal((1, r.n_embd)).astype(np.float32))
                      for s in seqs]
        t0 = time.perf_counter()
        outs = r.forward_many(chunks)
        took = time.perf_counter() - t0
        bad = [o for o in outs if isinstance(o, Exception)]
        if bad:
            raise bad[0]
        return took

    try:
        for rnd in range(ns.rounds):
            order = list(range(len(sets)))
            for i in order if rnd % 2 == 0 else order[::-1]:
                batch(sets[i])  # one untimed: the graph of this shape built
                times[i].append(statistics.median(batch(sets[i]) for _ in range(ns.steps)))
    finally:
        r.close()
    print(f"command: python -m bench.seqruns {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"{model.name}, layers {start}:{end}, {ns.threads} thread(s), {ns.rounds} rounds of {ns.steps} batches")
    for i, seqs in enumerate(sets):
        ms = [1000 * t for t in times[i]]
        print(f"  slots {','.join(map(str, seqs)):<20} {statistics.median(ms):7.1f} ms a batch "
              f"(rounds {', '.join(f'{m:.1f}' for m in ms)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
