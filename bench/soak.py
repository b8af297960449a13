"""Soak: a two-hop route under back-to-back sessions for minutes: ``python -m bench.soak``.

Starts two ``meshnode serve`` processes on 127.0.0.1 (layers 0:15 and 15:30 of the
default model, ``--max-sessions 8``, ``--metrics`` on a free port, one llama.cpp
thread each), then runs ``--sessions`` concurrent workers (default 8: every KV slot
of both nodes busy) for ``--duration`` seconds; each worker generates one session
after another (a prompt from a fixed list, 32-64 tokens, half greedy, half sampled
at temperature 0.8, all from a seeded RNG) through the ordinary initiator
(``meshnode.session.initiator.generate``: capabilities, tokenize, open, prefill,
delegated decode, release). Every ``--sample-every`` seconds it records each node's
memory (/proc/<pid>/status: ``VmRSS`` and its parts ``RssAnon`` and ``RssFile``)
and Health. When the time is up no new session starts; the running ones finish,
and both nodes must report ``live_sessions == 0``. It prints a summary and one JSON
object (also written to ``--json-out``).

Exit 1 if, on either node, live sessions do not return to 0 (a leaked KV sequence),
a session failed, the node exited, or its anonymous RSS grew more than
``--anon-bound-mb`` (default 25 MB) from the end of the warm-up (``--warmup``
seconds of full load, default 30) to the end.

Why the bound is on anonymous memory, and why 25 MB. Everything a node allocates
for good is in place after the warm-up: weights, KV cache (8 x 512 cells of 15
layers, allocated and cleared when the context is made), compute buffers, every
prompt-length and batch shape used once. Anonymous memory (heap, KV, buffers) is
where a leak grows; what may still move there is allocator fragmentation (glibc
arenas of the gRPC and llama.cpp threads), a few MB. File-backed RSS is different:
the weights are mmapped, and the head looks token embeddings up one row at a time
in its ~30 MB Q8_0 ``token_embd`` (vocab.gguf), so each token id sampled for the
first time can page in another 4 KB of the file -- it grows for a long time with
sampled text, is bounded by the files' size, and is clean page cache the kernel
may drop; it is reported, not bounded. A leak per session accumulates over the
sessions of the soak: 25 MB over N sessions catches any leak above 25 MB / N per
session (printed: ~100 KB for the ~260 post-warm-up sessions a 5-minute run
completes on a shared 2-vCPU machine; a leaked gRPC channel with its buffers, or a
session's state kept alive with its KV bookkeeping, is in that range); the least-
squares slope of anonymous RSS (MB/min, also printed) shows smaller drifts.

One llama.cpp thread per node (``--node-flags``) because both nodes share the
machine: with the defaults (``--threads-batch`` = all cores, per node) every
multi-token batch -- prefills and the cross-session decode batches -- puts 2 x 2
busy-waiting ggml threads on 2 vCPUs, and 4-8 concurrent sessions collapse to a
few tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPTS = [
    "The three primary colors are",
    "The capital of France is",
    "Write a short poem about the sea.",
    "List four planets of the solar system:",
    "Explain in one sentence why the sky is blue.",
    "A recipe for pancakes needs",
    "The quick brown fox",
    "Once upon a time, in a small village by the mountains,",
    "def fibonacci(n):",
    "The most important rule of writing clear documentation is",
    "Translate to French: Good morning, how are you?",
    "Three tips for learning a new language:",
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible",
    "Q: What is 12 times 7?\nA:",
]


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous and file-backed parts (/proc/<pid>/status), in MB."""
    kb = {k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in
                                                Path(f"/proc/{pid}/status").read_text().splitlines())
          if k in ("VmRSS", "RssAnon", "RssFile")}
    return {"rss": round(kb["VmRSS"] / 1024, 1), "anon": round(kb["RssAnon"] / 1024, 1),
            "file": round(kb["RssFile"] / 1024, 1)}


def scrape_errors(url: str) -> dict[str, int]:
    """The node's ``meshnode_errors_total`` by code, from its Prometheus metrics."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(r'^meshnode_errors_total\{code="([A-Z_]+)"\} (\S+)$', text, re.M)}


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


@dataclass
class Tally:
    sessions: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    #: sessions completed when the warm-up ended
    sessions_at_warmup: int = 0


def soak(peers: list[str], pids: list[int], ns: argparse.Namespace) -> dict[str, Any]:
    """The load and the samples (one asyncio thread for all grpc work, as ``meshnode generate`` has)."""
    import trio

    from meshnode import errors
    from meshnode.identity import NodeIdentity
    from meshnode.session.initiator import GenerateConfig, generate
    from meshnode.session.sampling import GREEDY, SamplingParams
    from meshnode.transport.aiothread import AioThread, open_aio_thread
    from meshnode.transport.client import health

    ident = NodeIdentity.generate()  # the initiator's key; nothing is written to a state dir
    tally = Tally()
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    warm_end, deadline = t0 + ns.warmup, t0 + ns.duration

    async def healths(aio: AioThread) -> list[Any]:
        return [await aio.run(health, p, 5.0) for p in peers]

    async def worker(aio: AioThread, k: int) -> None:
        rng = random.Random(ns.seed * 1000 + k)
        while time.monotonic() < deadline:  # no new session after the deadline
            greedy = rng.random() < 0.5
            sampling = GREEDY if greedy else SamplingParams(seed=rng.randrange(1 << 30))  # Llama's defaults
            cfg = GenerateConfig(prompt=rng.choice(PROMPTS), max_tokens=rng.randint(32, 64), sampling=sampling)
            try:
                result = await aio.run(generate, peers, cfg, ident)
            except errors.MeshnodeError as e:
                tally.errors[e.code] += 1
                if len(tally.error_samples) < 10:
                    tally.error_samples.append(str(e))
                await trio.sleep(0.5)  # a failing route: do not spin
                continue
            tally.sessions += 1
            tally.tokens += len(result.tokens)
            tally.prompt_tokens += len(result.prompt_tokens)

    async def sample(aio: AioThread, phase: str) -> dict[str, Any]:
        hs = await healths(aio)
        row = {"t": round(time.monotonic() - t0, 1), "phase": phase, "sessions": tally.sessions,
               "memory_mb": [memory_mb(pid) for pid in pids], "live_sessions": [h.live_sessions for h in hs],
               "steps_total": [h.steps_total for h in hs], "batches_total": [h.batches_total for h in hs]}
        samples.append(row)
        if ns.verbose:
            mem = " ".join(f"{m['rss']}({m['anon']}+{m['file']})" for m in row["memory_mb"])
            print(f"  t={row['t']:>6}s {phase:<6} sessions={row['sessions']:>5} rss(anon+file)={mem} MB "
                  f"live={row['live_sessions']}", flush=True)
        return row

    async def sampler(aio: AioThread) -> None:
        await trio.sleep(max(0.0, min(warm_end - time.monotonic(), ns.sample_every)))
        while time.monotonic() < warm_end:
            await sample(aio, "warmup")
            await trio.sleep(max(0.0, min(warm_end - time.monotonic(), ns.sample_every)))
        tally.sessions_at_warmup = tally.sessions
        await sample(aio, "start")
        while True:
            await trio.sleep(max(0.0, min(deadline - time.monotonic(), ns.sample_every)))
            if time.monotonic() >= deadline:
                return
            await sample(aio, "load")

    async def main() -> dict[str, Any]:
        async with open_aio_thread() as aio:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler, aio)
                for k in range(ns.sessions):
                    nursery.start_soon(worker, aio, k)
            # every worker has finished its last session; the nodes free their KV on release
            stopped = time.monotonic()
            with trio.move_on_after(30):
                # another process's state: polled over Health (bounded)
                while not all(h.live_sessions == 0 for h in await healths(aio)):  # noqa: ASYNC110
                    await trio.sleep(0.2)
            settle = time.monotonic() - stopped
            end = await sample(aio, "end")
            hs = await healths(aio)
        return {"end": end, "settle_s": round(settle, 2), "wall_s": round(stopped - t0, 1),
                "health": [{"live_sessions": h.live_sessions, "free_sessions": h.free_sessions,
                            "tokens_total": h.tokens_total, "errors_total": h.errors_total,
                            "steps_total": h.steps_total, "batches_total": h.batches_total,
                            "step_seconds_mean": h.step_seconds_mean} for h in hs]}

    out: dict[str, Any] = trio.run(main)
    out["tally"], out["samples"] = tally, samples
    return out


def node_report(i: int, layers: str, endpoint: str, boot: dict[str, float], samples: list[dict[str, Any]],
                health: dict[str, Any], errors_by_code: dict[str, int], alive: bool) -> dict[str, Any]:
    """One node's figures: memory at start (after warm-up), max and end, growth, Health counters."""
    mem = [(s["t"], s["memory_mb"][i]) for s in samples if s["phase"] in ("start", "load", "end")]
    start, end = mem[0][1], mem[-1][1]
    out: dict[str, Any] = {"layers": layers, "endpoint": endpoint, "alive_at_end": alive}
    for k in ("rss", "anon", "file"):
        out[f"{k}_boot_mb"] = boot[k]
        out[f"{k}_start_mb"] = start[k]
        out[f"{k}_max_mb"] = max(m[k] for _, m in mem)
        out[f"{k}_end_mb"] = end[k]
        out[f"{k}_growth_mb"] = round(end[k] - start[k], 1)
        out[f"{k}_slope_mb_per_min"] = round(slope_mb_per_min([(t, m[k]) for t, m in mem]), 2)
    out.update({
        "live_sessions_end": health["live_sessions"], "free_sessions_end": health["free_sessions"],
        "tokens_total": health["tokens_total"], "errors_total": health["errors_total"],
        "errors_by_code": errors_by_code, "steps_total": health["steps_total"],
        "batches_total": health["batches_total"],
        "mean_batch": round(health["steps_total"] / health["batches_total"], 2) if health["batches_total"] else 0.0,
        "step_ms_mean": round(health["step_seconds_mean"] * 1e3, 2),
    })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    ap.add_argument("--sessions", type=int, default=8, help="concurrent workers, each one session after another")
    ap.add_argument("--max-sessions", type=int, default=8, help="each node's KV sessions (default 8)")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the start sample (default 30)")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS/Health samples")
    ap.add_argument("--anon-bound-mb", type=float, default=25.0,
                    help="allowed growth of a node's anonymous RSS after warm-up (default 25)")
    ap.add_argument("--node-flags", default="--threads 1 --threads-batch 1",
                    help="more flags for both nodes (default: one llama.cpp thread each, as two nodes share the cores)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", help="GGUF file (default: the default model, pulled and verified)")
    ap.add_argument("--json-out", metavar="FILE", help="also write the JSON result here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every sample")
    ns = ap.parse_args(argv)
    if not 0 < ns.warmup < ns.duration:
        ap.error("--warmup must be positive and shorter than --duration")

    from meshnode.executor._bindings import silence_llama_logs
    from meshnode.gguf import ensure_range, inspect_model
    from meshnode.models import pull
    from meshnode.runtime.launch import local_route

    silence_llama_logs()
    model = Path(ns.model) if ns.model else pull()
    n_layer = inspect_model(model).n_layer
    cuts = [f"0:{n_layer // 2}", f"{n_layer // 2}:{n_layer}"]
    for c in cuts:  # cut here, so neither node's memory includes cutting its artifact
        a, b = c.split(":")
        ensure_range(model, int(a), int(b))
    extra = ["--max-sessions", str(ns.max_sessions), "--ctx-size", "512", "--metrics", "127.0.0.1:0",
             *shlex.split(ns.node_flags)]
    print(f"command: python -m bench.soak {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"model {model.name}, cuts {','.join(cuts)}, node flags {shlex.join(extra)}; {ns.sessions} workers for "
          f"{ns.duration:.0f}s (warm-up {ns.warmup:.0f}s), a sample every {ns.sample_every:.0f}s; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with local_route(model, cuts, extra=extra) as nodes:
        peers = [n.endpoint for n in nodes]
        pids = [n.proc.pid for n in nodes]
        metrics = [json.loads((Path(str(n.state_dir)) / "node.json").read_text())["metrics"] for n in nodes]
        boot = [memory_mb(pid) for pid in pids]
        out = soak(peers, pids, ns)
        errors_by_code = [scrape_errors(u) for u in metrics]
        alive = [n.proc.poll() is None for n in nodes]
    tally: Tally = out["tally"]
    samples = out["samples"]
    per_node = [node_report(i, c, peers[i], boot[i], samples, out["health"][i], errors_by_code[i], alive[i])
                for i, c in enumerate(cuts)]
    n_after = tally.sessions - tally.sessions_at_warmup
    failures = []
    for n in per_node:
        if n["live_sessions_end"] != 0:
            failures.append(f"node {n['layers']}: {n['live_sessions_end']} live sessions at the end")
        if n["anon_growth_mb"] > ns.anon_bound_mb:
            failures.append(f"node {n['layers']}: anonymous RSS grew {n['anon_growth_mb']} MB > {ns.anon_bound_mb} MB")
        if not n["alive_at_end"]:
            failures.append(f"node {n['layers']}: exited during the soak")
    if tally.errors:
        failures.append(f"{sum(tally.errors.values())} sessions failed: {dict(tally.errors)}")
    result = {
        "command": f"python -m bench.soak {shlex.join(sys.argv[1:] if argv is None else argv)}",
        "duration_s": ns.duration, "warmup_s": ns.warmup, "workers": ns.sessions, "max_sessions": ns.max_sessions,
        "node_flags": extra, "wall_s": out["wall_s"], "sessions_completed": tally.sessions,
        "sessions_after_warmup": n_after, "tokens_generated": tally.tokens, "prompt_tokens": tally.prompt_tokens,
        "tokens_per_second": round(tally.tokens / out["wall_s"], 1), "session_errors": dict(tally.errors),
        "error_samples": tally.error_samples, "settle_s": out["settle_s"], "anon_bound_mb": ns.anon_bound_mb,
        "leak_detectable_kb_per_session": round(ns.anon_bound_mb * 1024 / n_after, 1) if n_after else None,
        "nodes": per_node, "samples": samples, "failures": failures, "ok": not failures,
    }
    print(f"\n{tally.sessions} sessions completed ({n_after} after warm-up), {tally.tokens} tokens generated "
          f"({result['tokens_per_second']} tok/s over {out['wall_s']}s), {sum(tally.errors.values())} failed"
          f"{' ' + str(dict(tally.errors)) if tally.errors else ''}; live sessions 0 on both nodes "
          f"{out['settle_s']}s after the last session ended")
    print(f"{'node':<7}{'MB':<6}{'boot':>7}{'start':>8}{'max':>8}{'end':>8}{'growth':>8}{'MB/min':>8}")
    for n in per_node:
        for k in ("rss", "anon", "file"):
            print(f"{n['layers'] if k == 'rss' else '':<7}{k:<6}{n[k + '_boot_mb']:>7.1f}{n[k + '_start_mb']:>8.1f}"
                  f"{n[k + '_max_mb']:>8.1f}{n[k + '_end_mb']:>8.1f}{n[k + '_growth_mb']:>8.1f}"
                  f"{n[k + '_slope_mb_per_min']:>8.2f}")
    print(f"{'node':<7}{'live':>5}{'free':>5}{'tokens':>9}{'errors':>7}{'batch':>7}{'step ms':>9}   (node Health)")
    for n in per_node:
        print(f"{n['layers']:<7}{n['live_sessions_end']:>5}{n['free_sessions_end']:>5}{n['tokens_total']:>9}"
              f"{n['errors_total']:>7}{n['mean_batch']:>7.2f}{n['step_ms_mean']:>9.2f}")
    print(f"anonymous-RSS bound {ns.anon_bound_mb:g} MB per node after warm-up: over {n_after} sessions it catches a "
          f"leak above {result['leak_detectable_kb_per_session']} KB per session")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    doc = json.dumps(result)
    if ns.json_out:
        Path(ns.json_out).write_text(doc + "\n")
    print(doc)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
