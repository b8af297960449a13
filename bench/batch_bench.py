"""Concurrent sessions, route vs whole model: ``python -m bench.batch_bench``.

Aggregate greedy decode tokens/s for 1, 4 and 8 concurrent sessions (``--sessions``), each with its own prompt:

* **whole** -- the whole model in a child process through llama-cpp-python's low-level API, all sessions
  decoded as ONE batch: one token per sequence per ``llama_decode`` (``llama_batch_init(512, 0, n_seq_max)``).
  Its context equals a route node's (meshnode/executor/_llama.py): ``n_seq_max`` = the nodes'
  ``--max-sessions``, ``n_ctx`` = 512 x that, ``n_batch`` = ``n_ubatch`` = 512, ``kv_unified`` off, flash
  attention off, the nodes' thread counts;
* **route** -- ``meshnode serve`` child processes on 127.0.0.1 (default two halves, ``--max-sessions 8``),
  the sessions driven concurrently from this process (one asyncio thread, ``RouteSession``) with
  delegated decode (the head runs each session's decode loop, the default of ``generate()``); the hops
  batch concurrent sessions' steps on their own (``RangeExecutor.pick_batch``).

Both sides prefill every session first (the same token ids), then all sessions decode ``--tokens`` steps
from one start; aggregate tok/s = decoded tokens of all sessions / wall time from that start until the
last session is done. Gain 1->N = aggregate(N) / aggregate(1) of the same side; target: the route's gain
from 1 to 8 sessions >= 0.90 x the whole model's. The mean batch size each hop achieved during decode is
steps/batches from the difference of its ``Health`` (``steps_total``, ``batches_total``).

Each measurement is repeated ``--runs`` times, alternating whole and route (the nodes stay up; both sides
warm up first), and the median is reported. ``--json`` adds one machine-readable object at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._setup import model_and_cuts, print_header, thread_counts

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "The history of the printing press begins",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived",
    "The quick brown fox",
    "import numpy as",
    "Water boils at a temperature of",
]
ROOT = Path(__file__).resolve().parents[1]


# -- the whole model, one batch of all sessions, in a child process -----------------------------------------


def whole_child(model: str, sessions: list[int], n_tokens: int, threads: int, threads_batch: int,
                n_seq_max: int) -> dict[str, Any]:
    import ctypes

    import llama_cpp
    import numpy as np

    from meshnode.executor._bindings import silence_llama_logs

    silence_llama_logs()
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # read into memory, as a node does (route_bench.whole_child)
    mdl = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 512 * n_seq_max
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_seq_max = n_seq_max
    cp.n_threads = threads
    cp.n_threads_batch = threads_batch
    cp.kv_unified = False
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.embeddings = False
    cp.no_perf = True
    ctx = llama_cpp.llama_init_from_model(mdl, cp)
    mem = llama_cpp.llama_get_memory(ctx)
    vocab = llama_cpp.llama_model_get_vocab(mdl)
    n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
    batch = llama_cpp.llama_batch_init(512, 0, n_seq_max)

    def tokenize(text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(raw) + 8, True, True)
        return list(buf[:n])

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        """rows = [(token, pos, seq, wants_logits)]"""
        batch.n_tokens = len(rows)
        for k, (tok, pos, seq, out) in enumerate(rows):
            batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, pos, 1
            batch.seq_id[k][0] = seq
            batch.logits[k] = out
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                    shape=(n_vocab,))))

    ids = [tokenize(p) for p in PROMPTS]

    def run(n: int, steps: int) -> tuple[float, list[list[int]]]:
        llama_cpp.llama_memory_clear(mem, True)
        toks: list[list[int]] = []
        for s in range(n):  # prefill each session alone (prompts differ in length)
            decode([(t, j, s, j == len(ids[s]) - 1) for j, t in enumerate(ids[s])])
            toks.append([argmax(len(ids[s]) - 1)])
        t0 = time.perf_counter()
        for _ in range(steps):  # one batch: one token of every session
            decode([(toks[s][-1], len(ids[s]) + len(toks[s]) - 1, s, True) for s in range(n)])
            for s in range(n):
                toks[s].append(argmax(s))
        return time.perf_counter() - t0, toks

    out: dict[str, Any] = {"ids": ids, "by_n": {}}
    for n in sessions:
        run(n, 4)  # warm-up: this batch shape's graph
        took, toks = run(n, n_tokens)
        out["by_n"][str(n)] = {"tps": n * n_tokens / took, "seconds": took, "tokens": toks}
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(mdl)
    return out


def run_whole(model: Path, sessions: list[int], n_tokens: int, threads: int, threads_batch: int,
              n_seq_max: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.batch_bench", "--whole-child", "--model", str(model), "--tokens",
           str(n_tokens), "--threads", str(threads), "--threads-batch", str(threads_batch),
           "--sessions", ",".join(map(str, sessions)), "--max-sessions", str(n_seq_max)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


# -- the route ------------------------------------------------------------------------------------------------


async def _route_round(peers: list[str], caps: list[Any], prompts: list[list[int]], n_tokens: int,
                       ident: Any) -> dict[str, Any]:
    """All sessions: open + prefill, then decode from one start; aggregate tok/s and each hop's batching."""
    import asyncio

    from meshnode.session.initiator import GenerateConfig, RouteSession
    from meshnode.transport.client import health

    sessions = [RouteSession(peers, caps, GenerateConfig(prompt="", max_tokens=n_tokens + 1), ident)
                for _ in prompts]
    try:
        await asyncio.gather(*(rs.open() for rs in sessions))

        async def prefill(rs: RouteSession, ids: list[int]) -> int:
            chunk = rs.limits.max_prefill_chunk_tokens or len(ids)
            for i in range(0, len(ids), chunk):
                result = await rs.step(ids[i : i + chunk], sample=i + chunk >= len(ids))
            return int(result.token)

        firsts = await asyncio.gather(*(prefill(rs, ids) for rs, ids in zip(sessions, prompts, strict=True)))
        h0 = await asyncio.gather(*(health(p) for p in peers))

        async def decode(rs: RouteSession, first: int) -> tuple[list[int], float]:
            toks = [first]
            async for r in rs.generate(first, n_tokens):  # delegated: the head runs the loop
                toks.append(r.token)
            return toks, time.perf_counter()

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(decode(rs, f) for rs, f in zip(sessions, firsts, strict=True)))
        h1 = await asyncio.gather(*(health(p) for p in peers))
        await asyncio.gather(*(rs.release() for rs in sessions))
    except BaseException:
        for rs in sessions:
            await rs.close()
        raise
    decoded = sum(len(t) - 1 for t, _ in outs)
    took = max(end for _, end in outs) - t0
    hops = [{"steps": b.steps_total - a.steps_total, "batches": b.batches_total - a.batches_total}
            for a, b in zip(h0, h1, strict=True)]
    return {"tps": decoded / took, "seconds": took, "decoded": decoded, "tokens": [t for t, _ in outs],
            "hops": [{**h, "mean_batch": h["steps"] / h["batches"] if h["batches"] else 0.0} for h in hops]}


def run_route(peers: list[str], ids: list[list[int]], sessions: list[int], n_tokens: int,
              warm: bool = False) -> dict[str, Any]:
    import trio

    from meshnode.identity import NodeIdentity
    from meshnode.session.initiator import check_route
    from meshnode.transport.aiothread import open_aio_thread

    ident = NodeIdentity.generate()

    async def main() -> dict[str, Any]:
        by_n: dict[str, Any] = {}
        async with open_aio_thread() as aio:  # one asyncio loop for all grpc work, as `meshnode generate` has
            caps = await aio.run(check_route, peers)
            if warm:
                await aio.run(_route_round, peers, caps, ids[: max(sessions)], 4, ident)
            for n in sessions:
                by_n[str(n)] = await aio.run(_route_round, peers, caps, ids[:n], n_tokens, ident)
        return {"by_n": by_n}

    result: dict[str, Any] = trio.run(main)
    return result


# -- driver ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.batch_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the default model, pulled and verified)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy decode steps per session per measurement")
    ap.add_argument("--runs", type=int, default=3, help="repetitions (median reported)")
    ap.add_argument("--sessions", default="1,4,8", help="comma-separated session counts (first = the baseline)")
    ap.add_argument("--threads", type=int, default=0, help="decode threads, both sides (default: cores/2)")
    ap.add_argument("--threads-batch", type=int, default=0, help="batch threads, both sides (default: cores)")
    ap.add_argument("--max-sessions", type=int, default=8, help="node KV sessions = the whole model's n_seq_max")
    ap.add_argument("--cuts", help="comma-separated layer ranges, e.g. 0:15,15:30 (default: two halves)")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--whole-child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    threads, threads_batch = thread_counts(ns)
    sessions = [int(x) for x in ns.sessions.split(",")]
    if max(sessions) > min(ns.max_sessions, len(PROMPTS)):
        ap.error(f"--sessions may not exceed --max-sessions ({ns.max_sessions}) or {len(PROMPTS)} prompts")
    if ns.whole_child:
        print(json.dumps(whole_child(ns.model, sessions, ns.tokens, threads, threads_batch, ns.max_sessions)))
        return 0

    from meshnode.runtime.launch import local_route

    model, n_layer, cuts = model_and_cuts(ns)
    # --ctx-size 512: the same per-session context as the whole model's (n_ctx = 512 x n_seq_max)
    extra = ["--threads", str(threads), "--threads-batch", str(threads_batch), "--max-sessions", str(ns.max_sessions),
             "--ctx-size", "512"]
    print_header("batch_bench", argv, model, n_layer, cuts, threads, threads_batch, extra)
    print(f"whole: n_seq_max={ns.max_sessions} n_ctx={512 * ns.max_sessions} n_batch=n_ubatch=512 kv_unified=off "
          f"flash_attn=off; {ns.tokens} decode steps per session")
    wholes: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    with local_route(model, cuts, extra=extra) as nodes:
        peers = [n.endpoint for n in nodes]
        for r in range(ns.runs):
            order = ["whole", "route"] if r % 2 == 0 or not wholes else ["route", "whole"]
            for which in order:
                if which == "whole":
                    wholes.append(run_whole(model, sessions, ns.tokens, threads, threads_batch, ns.max_sessions))
                else:
                    routes.append(run_route(peers, wholes[0]["ids"], sessions, ns.tokens, warm=not routes))
            print(f"run {r + 1}/{ns.runs} ({' then '.join(order)}): "
                  + "; ".join(f"N={n} whole {wholes[-1]['by_n'][str(n)]['tps']:.1f} route "
                              f"{routes[-1]['by_n'][str(n)]['tps']:.1f}" for n in sessions) + " tok/s", flush=True)

    def med(rows: list[dict[str, Any]], n: int, key: str) -> float:
        return statistics.median(row["by_n"][str(n)][key] for row in rows)

    base = sessions[0]
    table = []
    for n in sessions:
        w, rt = med(wholes, n, "tps"), med(routes, n, "tps")
        wg, rg = w / med(wholes, base, "tps"), rt / med(routes, base, "tps")
        batch = [statistics.median(row["by_n"][str(n)]["hops"][i]["mean_batch"] for row in routes)
                 for i in range(len(cuts))]
        # the route stops a session at end-of-generation, the whole batch decodes on: compare the route's part
        same = all(r_t == w_t[: len(r_t)] for row in routes
                   for r_t, w_t in zip(row["by_n"][str(n)]["tokens"], wholes[0]["by_n"][str(n)]["tokens"], strict=True))
        short = any(row["by_n"][str(n)]["decoded"] != n * ns.tokens for row in routes)
        table.append({"sessions": n, "whole_tps": w, "route_tps": rt, "route_over_whole": rt / w, "whole_gain": wg,
                      "route_gain": rg, "gain_ratio": rg / wg, "mean_batch": batch, "tokens_identical": same,
                      "ended_early": short})

    print(f"\nmedian of {ns.runs} runs; aggregate decode tok/s of all sessions; gain = tok/s(N) / tok/s({base})")
    print(f"{'N':>3}{'whole tok/s':>13}{'route tok/s':>13}{'route/whole':>13}{'whole gain':>12}{'route gain':>12}"
          f"{'gain ratio':>12}  {'mean batch per hop':<20}tokens identical")
    for t in table:
        print(f"{t['sessions']:>3}{t['whole_tps']:>13.1f}{t['route_tps']:>13.1f}{t['route_over_whole']:>13.3f}"
              f"{t['whole_gain']:>12.2f}{t['route_gain']:>12.2f}{t['gain_ratio']:>12.3f}  "
              f"{' / '.join(f'{b:.2f}' for b in t['mean_batch']):<20}{t['tokens_identical']}"
              f"{'  (a session hit end-of-generation early)' if t['ended_early'] else ''}")
    last = table[-1]
    verdict = "PASS" if last["gain_ratio"] >= 0.9 else "FAIL"
    print(f"target: route gain {base}->{last['sessions']} >= 0.90 x whole gain: {last['gain_ratio']:.3f} {verdict}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if ns.json:
        print(json.dumps({
            "model": str(model), "cuts": cuts, "runs": ns.runs, "tokens": ns.tokens, "threads": threads,
            "threads_batch": threads_batch, "node_flags": extra, "sessions": sessions, "table": table,
            "target": {"gain_ratio": 0.9, "met": last["gain_ratio"] >= 0.9},
            "per_run": {
                "whole": [{n: {k: v for k, v in d.items() if k != "tokens"} for n, d in w["by_n"].items()}
                          for w in wholes],
                "route": [{n: {k: v for k, v in d.items() if k != "tokens"} for n, d in r["by_n"].items()}
                          for r in routes]},
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
