"""Route vs whole model, side by side on one machine: ``python -m bench.route_bench``.

Measures, on the same GGUF (default: the default model, ``meshnode.models.pull()``):

* **whole** -- the whole model in llama-cpp-python (``llama_cpp.Llama``, default context settings), in a
  separate child process so its peak RSS is its own;
* **route** -- ``meshnode serve`` child processes on 127.0.0.1, one per ``--cuts`` range (default two
  halves), driven from here through ``RouteSession`` on an asyncio thread as ``meshnode demo`` does.

For both: prefill time of one 256-token prompt (the same token ids on both sides, built by the whole
child), greedy decode tokens/s over ``--tokens`` single-token steps after the short prompt "The three
primary colors are" and after the 256-token prompt, and whether the greedy tokens are identical. For the
route also: bytes received per decoded token per hop (activation payload, from ``HopTiming.bytes_in``, and
the serialized size of the step frame that hop receives), llama.cpp compute time per token per hop, and each
node's peak RSS. Peak RSS is ``VmHWM`` from /proc/<pid>/status for every process; the whole child's
``ru_maxrss`` is printed too, but after fork+exec Linux folds the parent's peak into it.

Each measurement is repeated ``--runs`` times, alternating whole and route runs (the nodes stay up across
runs; each side warms up on the short prompt first), and the median is reported. Targets: decode ratio
(route/whole) >= 0.90, prefill ratio (whole_time/route_time) >= 0.90, half-range node RSS <= 0.65 x whole.

Reproduce: ``. .venv/bin/activate && python -m bench.route_bench`` from the repository root
(``--json`` adds one machine-readable object at the end).
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
from bench.memory_bench import proc_status_mb

SHORT_PROMPT = "The three primary colors are"
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to reproduce books quickly and cheaply. Within a few decades, presses had spread to hundreds of cities across "
    "Europe, and the number of books in circulation grew from thousands to millions. Scholars exchanged ideas faster "
    "than ever before, vernacular languages gained standard spellings, and literacy slowly rose among merchants, "
    "artisans and farmers. "
)
LONG_TOKENS = 256
ROOT = Path(__file__).resolve().parents[1]


# -- the whole model, in a child process (imports only llama_cpp and numpy) ---------------------------------


def whole_child(model: str, n_tokens: int, threads: int, threads_batch: int) -> dict[str, Any]:
    import resource

    import llama_cpp
    import numpy as np

    from meshnode.executor.hugepages import huge_bytes

    # weights read into memory, as a node reads them: decode from a mapped file rides on the page cache's
    # state (docs/performance.md, "Weights mapped or read"); read, the whole model is at its fastest
    llm = llama_cpp.Llama(model, verbose=False, n_threads=threads, n_threads_batch=threads_batch, use_mmap=False)
    n_vocab = llm.n_vocab()

    def argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    def run(prompt: list[int]) -> tuple[float, float, list[int]]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - t0
        toks = [argmax()]
        t1 = time.perf_counter()
        for _ in range(n_tokens):
            llm.eval([toks[-1]])
            toks.append(argmax())
        return prefill, time.perf_counter() - t1, toks

    short = llm.tokenize(SHORT_PROMPT.encode(), add_bos=True, special=True)
    text = LONG_TEXT
    while len(llm.tokenize(text.encode(), add_bos=True, special=True)) < LONG_TOKENS:
        text += LONG_TEXT
    long = llm.tokenize(text.encode(), add_bos=True, special=True)[:LONG_TOKENS]
    _, short_dec, short_toks = run(short)  # first: it also warms the context up
    prefill, long_dec, long_toks = run(long)
    return {"short_ids": short, "long_ids": long, "prefill_s": prefill, "decode_tps": n_tokens / short_dec,
            "decode_long_tps": n_tokens / long_dec, "short_tokens": short_toks, "long_tokens": long_toks,
            "rss_mb": proc_status_mb("self")["VmHWM"],
            "huge_mb": huge_bytes(Path("/proc/self/smaps_rollup").read_text()) / 2**20,
            "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_whole(model: Path, n_tokens: int, threads: int, threads_batch: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.route_bench", "--whole-child", "--model", str(model), "--tokens",
           str(n_tokens), "--threads", str(threads), "--threads-batch", str(threads_batch)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


# -- the route ------------------------------------------------------------------------------------------------


async def _session(peers: list[str], caps: list[Any], prompt: list[int], n_tokens: int) -> dict[str, Any]:
    import numpy as np

    from meshnode.identity import NodeIdentity
    from meshnode.proto import node_pb2 as pb
    from meshnode.session.initiator import GenerateConfig, RouteSession
    from meshnode.wire import codec
    from meshnode.wire.tensors import encode_bundle

    # a key of its own, as batch_bench's: not the user's node key in ~/.local/state
    rs = RouteSession(peers, caps, GenerateConfig(prompt="", max_tokens=n_tokens), NodeIdentity.generate())
    try:
        await rs.open()
        chunk = rs.limits.max_prefill_chunk_tokens or len(prompt)
        t0 = time.perf_counter()
        for i in range(0, len(prompt), chunk):
            result = await rs.step(prompt[i : i + chunk], sample=i + chunk >= len(prompt))
        prefill = time.perf_counter() - t0
        toks = [result.token]
        bytes_in = [0] * len(peers)
        compute = [0] * len(peers)
        handle = [0] * len(peers)
        t1 = time.perf_counter()
        # delegated decode, as `meshnode generate` does: the head runs the loop
        async for result in rs.generate(toks[-1], n_tokens):
            toks.append(result.token)
            for k, t in enumerate(result.timings):
                bytes_in[k] += t.bytes_in
                compute[k] += t.compute_nanos
                handle[k] += t.handle_nanos
        decode = time.perf_counter() - t1
        # serialized size of one decode step frame as each hop receives it (same field values as sent)
        step = pb.Step(step_id=rs.step_id, tokens=[toks[-2]], sample=True,
                       cache=pb.CacheExpectation(n_past=rs.n_past - 1), deadline_unix_nanos=codec.deadline_in(30.0))
        frames = [len(pb.SessionFrame(route_session_id=rs.id, route_epoch=rs.epoch, step=step).SerializeToString())]
        for cap in caps[1:]:
            act = encode_bundle(np.zeros((1, cap.n_embd), np.float32), pos_start=rs.n_past - 1,
                                max_chunk_bytes=rs.limits.max_chunk_bytes or 1 << 20)
            fwd = pb.Step(step_id=step.step_id, cache=step.cache, activation=act, sample=True,
                          deadline_unix_nanos=step.deadline_unix_nanos)
            frames.append(len(pb.SessionFrame(route_session_id=rs.id, route_epoch=rs.epoch,
                                              step=fwd).SerializeToString()))
        await rs.release()
    except BaseException:
        await rs.close()
        raise
    steps = len(toks) - 1  # fewer than n_tokens if the model ended its generation
    return {"prefill_s": prefill, "decode_tps": steps / decode, "tokens": toks,
            "bytes_in": [b / steps for b in bytes_in], "compute_ms": [c / steps / 1e6 for c in compute],
            "handle_ms": [h / steps / 1e6 for h in handle],
            "frame_bytes": frames}


def run_route(peers: list[str], short: list[int], long: list[int], n_tokens: int) -> dict[str, Any]:
    import trio

    from meshnode.session.initiator import check_route
    from meshnode.transport.aiothread import open_aio_thread

    async def main() -> dict[str, Any]:
        async with open_aio_thread() as aio:  # the initiator's loop, as `meshnode generate` has it
            caps = await aio.run(check_route, peers)
            s = await aio.run(_session, peers, caps, short, n_tokens)  # also the warm-up
            lo = await aio.run(_session, peers, caps, long, n_tokens)
        return {**s, "prefill_s": lo["prefill_s"], "decode_long_tps": lo["decode_tps"],
                "short_tokens": s["tokens"], "long_tokens": lo["tokens"]}

    result: dict[str, Any] = trio.run(main)
    return result


def where_time_goes(per_token_ms: float, hops: list[dict[str, Any]]) -> str:
    """Split a decoded token's time on the route, from each hop's HopTiming (compute = inside llama.cpp,
    handle = the hop's whole step, including the hops after it): llama.cpp per hop; the tail's step beyond
    llama.cpp (hand-off to its llama.cpp thread and back, sampling, codecs); for each hop pair, the upstream
    hop's step beyond its llama.cpp and the downstream hop's step (its hand-offs, encoding, gRPC both ways);
    and the head's generate loop between steps (per-token gap minus the head's step)."""
    comp = [h["compute_ms_per_token"] for h in hops]
    handle = [h["handle_ms_per_token"] for h in hops]
    link = [handle[i] - comp[i] - handle[i + 1] for i in range(len(hops) - 1)]
    parts = [f"llama.cpp {' + '.join(f'{c:.3f}' for c in comp)}",
             f"tail step beyond llama.cpp {handle[-1] - comp[-1]:.3f}",
             f"per hop pair, upstream step beyond llama.cpp and downstream step {' + '.join(f'{x:.3f}' for x in link)}",
             f"head loop between steps {per_token_ms - handle[0]:.3f}"]
    return "route per token, ms: " + "; ".join(parts)


# -- driver ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.route_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the default model, pulled and verified)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy decode steps per measurement")
    ap.add_argument("--runs", type=int, default=3, help="repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="decode threads, both sides (default: cores/2)")
    ap.add_argument("--threads-batch", type=int, default=0, help="prefill threads, both sides (default: cores)")
    ap.add_argument("--max-sessions", type=int, default=0, help="node KV sessions (default: the node default)")
    ap.add_argument("--cuts", help="comma-separated layer ranges, e.g. 0:15,15:30 (default: two halves)")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--whole-child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    threads, threads_batch = thread_counts(ns)
    if ns.whole_child:
        print(json.dumps(whole_child(ns.model, ns.tokens, threads, threads_batch)))
        return 0

    from meshnode.runtime.launch import local_route

    model, n_layer, cuts = model_and_cuts(ns)
    # --ctx-size 512: the same per-session context as the whole model's Llama default n_ctx
    extra = ["--threads", str(threads), "--threads-batch", str(threads_batch), "--ctx-size", "512"]
    if ns.max_sessions:
        extra += ["--max-sessions", str(ns.max_sessions)]
    print_header("route_bench", argv, model, n_layer, cuts, threads, threads_batch, extra)
    wholes: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    with local_route(model, cuts, extra=extra) as nodes:
        peers = [n.endpoint for n in nodes]
        for r in range(ns.runs):
            order = ["whole", "route"] if r % 2 == 0 or not wholes else ["route", "whole"]
            for which in order:
                if which == "whole":
                    wholes.append(run_whole(model, ns.tokens, threads, threads_batch))
                else:
                    routes.append(run_route(peers, wholes[0]["short_ids"], wholes[0]["long_ids"], ns.tokens))
            print(f"run {r + 1}/{ns.runs} ({' then '.join(order)}): decode whole {wholes[-1]['decode_tps']:.1f} "
                  f"route {routes[-1]['decode_tps']:.1f} tok/s; prefill-256 whole {wholes[-1]['prefill_s']:.3f} "
                  f"route {routes[-1]['prefill_s']:.3f} s", flush=True)
        node_rss = [(st['VmHWM'], st['VmRSS']) for st in map(proc_status_mb, (n.proc.pid for n in nodes))]

    def med(rows: list[dict[str, Any]], key: str, i: int | None = None) -> float:
        return statistics.median(row[key] if i is None else row[key][i] for row in rows)

    w_dec, r_dec = med(wholes, "decode_tps"), med(routes, "decode_tps")
    w_dl, r_dl = med(wholes, "decode_long_tps"), med(routes, "decode_long_tps")
    w_pre, r_pre = med(wholes, "prefill_s"), med(routes, "prefill_s")
    w_rss = med(wholes, "rss_mb")
    same_short = all(r["short_tokens"] == wholes[0]["short_tokens"] for r in routes)
    same_long = all(r["long_tokens"] == wholes[0]["long_tokens"] for r in routes)
    hops = [{"layers": c, "endpoint": p, "bytes_in_per_token": med(routes, "bytes_in", i),
             "frame_bytes_per_token": routes[-1]["frame_bytes"][i],
             "compute_ms_per_token": med(routes, "compute_ms", i),
             "handle_ms_per_token": med(routes, "handle_ms", i), "rss_mb": rss, "rss_now_mb": now,
             "rss_fraction": rss / w_rss}
            for i, (c, p, (rss, now)) in enumerate(zip(cuts, peers, node_rss, strict=True))]
    dec_ratio, dl_ratio, pre_ratio = r_dec / w_dec, r_dl / w_dl, w_pre / r_pre

    def ok(good: bool) -> str:
        return "PASS" if good else "FAIL"

    print(f"\nmedian of {ns.runs} runs, {ns.tokens} greedy decode steps, prompt ids identical on both sides")
    print(f"{'metric':<38}{'whole':>12}{'route':>12}{'ratio':>10}  target")
    print(f"{'decode tok/s (short prompt)':<38}{w_dec:>12.1f}{r_dec:>12.1f}{dec_ratio:>10.3f}  >= 0.90 route/whole "
          f"{ok(dec_ratio >= 0.9)}")
    print(f"{'decode tok/s (after 256-token prompt)':<38}{w_dl:>12.1f}{r_dl:>12.1f}{dl_ratio:>10.3f}  (route/whole)")
    print(f"{'prefill 256 tokens, s':<38}{w_pre:>12.4f}{r_pre:>12.4f}{pre_ratio:>10.3f}  >= 0.90 whole/route "
          f"{ok(pre_ratio >= 0.9)}")
    print(f"{'greedy tokens identical (short, 256)':<38}{'':>12}{f'{same_short}, {same_long}':>12}")
    print(f"{'peak RSS MB, whole process (VmHWM)':<38}{w_rss:>12.1f}   (its ru_maxrss: "
          f"{med(wholes, 'ru_maxrss_mb'):.1f}, includes this parent's peak)")
    print(f"\n{'hop':<8}{'endpoint':<18}{'payload B/tok':>14}{'frame B/tok':>13}{'compute ms/tok':>16}"
          f"{'RSS MB':>9}{'now MB':>9}{'RSS/whole':>11}  target <= 0.65")
    for h in hops:
        print(f"{h['layers']:<8}{h['endpoint']:<18}{h['bytes_in_per_token']:>14.0f}{h['frame_bytes_per_token']:>13}"
              f"{h['compute_ms_per_token']:>16.3f}{h['rss_mb']:>9.1f}{h['rss_now_mb']:>9.1f}"
              f"{h['rss_fraction']:>11.3f}  "
              f"{ok(h['rss_fraction'] <= 0.65)}")
    print("(payload = HopTiming.bytes_in: token ids at the head, the residual at later hops; frame = serialized "
          "SessionFrame that hop receives, rebuilt from the sent fields; RSS = peak VmHWM, now = VmRSS at the end)")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"route decode per token: {1e3 / r_dec:.3f} ms, of which llama.cpp compute "
          f"{sum(h['compute_ms_per_token'] for h in hops):.3f} ms; whole: {1e3 / w_dec:.3f} ms")
    print(where_time_goes(1e3 / r_dec, hops))
    if ns.json:
        print(json.dumps({
            "model": str(model), "cuts": cuts, "runs": ns.runs, "tokens": ns.tokens, "threads": threads,
            "threads_batch": threads_batch, "node_flags": extra,
            "whole": {"decode_tps": w_dec, "decode_long_tps": w_dl, "prefill_256_s": w_pre, "rss_mb": w_rss},
            "route": {"decode_tps": r_dec, "decode_long_tps": r_dl, "prefill_256_s": r_pre, "hops": hops,
                      "tokens_identical": {"short": same_short, "long": same_long}},
            "ratios": {"decode": dec_ratio, "decode_long": dl_ratio, "prefill": pre_ratio},
            "targets": {"decode": 0.9, "prefill": 0.9, "node_rss_fraction": 0.65},
            "per_run": {"whole": [{k: v for k, v in w.items() if "ids" not in k and "tokens" not in k} for w in wholes],
                        "route": [{k: v for k, v in r.items() if "tokens" not in k} for r in routes]},
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
