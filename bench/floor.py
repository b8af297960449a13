"""The floor of a route on one machine: the model's two halves run one after the other *in one process*
(``LlamaRange`` head, then tail: no gRPC, no second process, no wake-ups), against the whole model in
``Llama``, both at the same thread count, measured in turn: ``python -m bench.floor`` (issue 23, item 2).

What the ratio says: the route of two processes can at best reach it, whatever its transport costs,
because what remains is llama.cpp's own price of running a model as two graphs (a second OpenMP region,
a second input set-up, the cut at the head's last layer). Each round decodes ``--tokens`` single-token
steps on a fresh KV (8 prompt tokens first) with each side, in turn (A, B, B, A alternating by round).

    python -m bench.floor [--model GGUF] [--rounds 5] [--tokens 128] [--threads 2] [--mmap]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def _whole(model: Path, threads: int, tokens: int, mmap: bool = False) -> float:
    """Seconds a decode step of the whole model in ``Llama`` took, over ``tokens`` steps."""
    from llama_cpp import Llama

    llm = _whole.cache.get(model)  # type: ignore[attr-defined]
    if llm is None:
        llm = _whole.cache[model] = Llama(str(model), n_ctx=512, n_threads=threads,  # type: ignore[attr-defined]
                                          n_threads_batch=threads, verbose=False, use_mmap=mmap)
    llm.reset()
    llm.eval([1, 2, 3, 4, 5, 6, 7, 8])
    t0 = time.perf_counter()
    for i in range(tokens):
        llm.eval([100 + i % 50])
    return (time.perf_counter() - t0) / tokens


_whole.cache = {}  # type: ignore[attr-defined]


def _halves(head: object, tail: object, tokens: int) -> float:
    """Seconds a decode step of head then tail (one process) took, over ``tokens`` steps."""
    head.release(0)  # type: ignore[attr-defined]
    tail.release(0)  # type: ignore[attr-defined]
    h = head.forward(0, 0, tokens=np.arange(1, 9, dtype=np.int32))  # type: ignore[attr-defined]
    tail.forward(0, 0, embd=h.residual)  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for i in range(tokens):
        h = head.forward(0, 8 + i, tokens=np.array([100 + i % 50], np.int32))  # type: ignore[attr-defined]
        tail.forward(0, 8 + i, embd=h.residual)  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) / tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the 1.34 GB synthetic model, bench.synth)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mmap", action="store_true",
                    help="map the files on both sides (default: read into memory, as a node)")
    ns = ap.parse_args(argv)
    from bench.paths import huge_pages_here

    huge_pages_here()  # llama.cpp runs in this process: in the pages a node's runs in
    from bench.synth import ensure_model
    from meshnode.executor import openmp

    openmp.configure(ns.threads)  # the node's libgomp spin, before llama.cpp loads (as a node sets it)
    from meshnode.executor._llama import LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf import ensure_range
    from meshnode.gguf.model import inspect_model

    model = Path(ns.model) if ns.model else ensure_model(1.0)
    n = inspect_model(model).n_layer
    cfg = ExecConfig(n_ctx_per_session=512, max_sessions=1, n_threads=ns.threads, n_threads_solo=ns.threads,
                     n_threads_batch=ns.threads, use_mmap=ns.mmap)
    head = LlamaRange(ensure_range(model, 0, n // 2), cfg)
    tail = LlamaRange(ensure_range(model, n // 2, n), cfg)
    for r in (head, tail):
        r.decode_threads = ns.threads
    _whole(model, ns.threads, 8, ns.mmap)  # warm both
    _halves(head, tail, 8)
    ratios, wholes, halves = [], [], []
    for k in range(ns.rounds):
        order = ("whole", "halves") if k % 2 == 0 else ("halves", "whole")
        got = {}
        for side in order:
            got[side] = (_whole(model, ns.threads, ns.tokens, ns.mmap) if side == "whole"
                         else _halves(head, tail, ns.tokens))
        wholes.append(got["whole"])
        halves.append(got["halves"])
        ratios.append(got["whole"] / got["halves"])
        print(f"round {k + 1}: whole {1 / got['whole']:.2f} tok/s, halves in one process "
              f"{1 / got['halves']:.2f} tok/s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"{model.name}, {ns.threads} threads: whole {1 / statistics.median(wholes):.2f} tok/s, halves in one "
          f"process {1 / statistics.median(halves):.2f} tok/s; ratio (median of {ns.rounds} rounds) "
          f"{statistics.median(ratios):.3f}: {', '.join(f'{r:.3f}' for r in ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
