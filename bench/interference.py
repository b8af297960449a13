"""The floor under a one-machine route: llama.cpp compute alone, no transport.

Runs the head (0:15) and the tail (15:30) of the default model in two
processes that hand each other the residual and the sampled token over a
bare multiprocessing pipe (no gRPC, no event loop, no protobuf), and the
whole model in a third, and prints the per-token time of each. Whatever the
route's transport does, its decode ratio on one machine cannot beat
whole / (head + tail) measured here.

    python -m bench.interference [--tokens 128] [--threads N] [--spin ROUNDS] [--pin]

``--pin`` simulates two machines as the pinned benchmark does: the whole model and the
head on core 0, the tail on core 1, one thread each; it also times the three ranges
one after another in one process on core 0 (no second process, no pipe), which is the
split's own cost: head + tail against the whole model, the same tokens.

``--threads`` sets each process's llama.cpp threads (decode and batch), ``--spin``
libgomp's ``GOMP_SPINCOUNT`` in the head and tail processes (default: libgomp's own),
which is how docs/performance.md ("Threads") compared the ways idle threads wait.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics as st
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

PROMPT_IDS = [504, 3575, 282, 4649, 314]


def worker(cut: tuple[int, int], conn: Connection, threads: int, core: int | None = None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    from meshnode.executor._bindings import silence_llama_logs
    from meshnode.executor._llama import LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf import ensure_range
    from meshnode.models import pull

    silence_llama_logs()
    r = LlamaRange(ensure_range(pull(), *cut), ExecConfig(n_threads=threads, n_threads_batch=max(threads, 2),
                                                           max_sessions=1))
    conn.send("ready")
    comp: list[float] = []
    while (msg := conn.recv()) is not None:
        pos, x = msg
        t = time.perf_counter()
        out = r.forward(0, pos, tokens=x) if r.takes_tokens else r.forward(0, pos, embd=x)
        comp.append(time.perf_counter() - t)
        conn.send(out.residual if out.residual is not None else int(np.argmax(out.logits)))
    conn.send(st.median(comp[5:]) * 1e3)
    r.close()


def chain(cuts: list[tuple[int, int]], n: int, threads: int = 1,
          cores: list[int | None] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in cuts]
    cores = cores or [None] * len(cuts)
    procs = [ctx.Process(target=worker, args=(c, b, threads, k))
             for c, (_, b), k in zip(cuts, pipes, cores, strict=True)]
    for p in procs:
        p.start()
    ends = [a for a, _ in pipes]
    for a in ends:
        a.recv()
    toks: Any = np.array(PROMPT_IDS, dtype=np.int32)
    pos, ts = 0, []
    for _ in range(n + 5):
        t = time.perf_counter()
        x: Any = toks
        for a in ends:
            a.send((pos, x))
            x = a.recv()
        ts.append(time.perf_counter() - t)
        pos += len(toks)
        toks = np.array([x], dtype=np.int32)
    for a in ends:
        a.send(None)
    computes = [a.recv() for a in ends]
    for p in procs:
        p.join()
    return {"per_token_ms": st.median(ts[5:]) * 1e3, "compute_ms": computes}


def split_in_one_process(n: int) -> dict[str, float]:
    """Whole, head and tail one after another per token in this process: ms per token of each."""
    from meshnode.executor._bindings import silence_llama_logs
    from meshnode.executor._llama import LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf import ensure_range
    from meshnode.models import pull

    silence_llama_logs()
    model = pull()
    ranges = [LlamaRange(ensure_range(model, a, b), ExecConfig(n_threads=1, n_threads_batch=1, max_sessions=1))
              for a, b in ((0, 30), (0, 15), (15, 30))]
    whole, head, tail = ranges
    toks: Any = np.array(PROMPT_IDS, dtype=np.int32)
    pos, times = 0, [[], [], []]
    for i in range(n + 5):
        t0 = time.perf_counter()
        w = whole.forward(0, pos, tokens=toks)
        t1 = time.perf_counter()
        h = head.forward(0, pos, tokens=toks)
        t2 = time.perf_counter()
        r = tail.forward(0, pos, embd=h.residual)
        t3 = time.perf_counter()
        tok = int(np.argmax(w.logits))
        if tok != int(np.argmax(r.logits)):
            raise SystemExit(f"token {i}: the split disagrees with the whole model")
        if i >= 5:
            for k, d in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(d)
        pos += len(toks)
        toks = np.array([tok], dtype=np.int32)
    for x in ranges:
        x.close()
    return {k: st.median(v) * 1e3 for k, v in zip(("whole", "head", "tail"), times, strict=True)}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads of each process")
    ap.add_argument("--spin", type=int, help="GOMP_SPINCOUNT of the head and tail processes")
    ap.add_argument("--pin", action="store_true", help="whole and head on core 0, tail on core 1, 1 thread")
    ns = ap.parse_args()
    if ns.pin:
        os.sched_setaffinity(0, {0})
        split = split_in_one_process(ns.tokens)
        print(f"one process, core 0, in turn: whole {split['whole']:.2f} ms/token, head {split['head']:.2f} + "
              f"tail {split['tail']:.2f} = {split['head'] + split['tail']:.2f} "
              f"(split cost {(split['head'] + split['tail']) / split['whole'] - 1:+.1%})")
        whole = chain([(0, 30)], ns.tokens, 1, [0])
        route = chain([(0, 15), (15, 30)], ns.tokens, 1, [0, 1])
        print(f"whole model, core 0       : {whole['per_token_ms']:.2f} ms/token")
        print(f"head core 0 + tail core 1 : {route['per_token_ms']:.2f} ms/token "
              f"(compute head {route['compute_ms'][0]:.2f}, tail {route['compute_ms'][1]:.2f})")
        print(f"ceiling of a pinned route's decode ratio: {whole['per_token_ms'] / route['per_token_ms']:.3f}")
        return
    whole = chain([(0, 30)], ns.tokens, ns.threads)  # the whole model waits as libgomp does by default
    if ns.spin is not None:
        os.environ["GOMP_SPINCOUNT"] = str(ns.spin)  # inherited by the spawned head and tail
    route = chain([(0, 15), (15, 30)], ns.tokens, ns.threads)
    print(f"whole model, 1 process : {whole['per_token_ms']:.2f} ms/token")
    print(f"head+tail, 2 processes : {route['per_token_ms']:.2f} ms/token "
          f"(compute head {route['compute_ms'][0]:.2f}, tail {route['compute_ms'][1]:.2f})")
    print(f"ceiling of a one-machine route's decode ratio: {whole['per_token_ms'] / route['per_token_ms']:.3f}")


if __name__ == "__main__":
    main()
