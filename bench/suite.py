"""Every comparison of docs/performance.md in one run: ``python -m bench``.

Sections (``--only`` picks some), each printing both sides' figures, thread counts and the load average:

* **one-machine** -- the whole model in ``Llama`` at its fastest thread count (each of 1..cores tried,
  ``--runs`` times, the best median kept) beside a two-hop route of ``meshnode serve`` processes with
  their default settings, measured through ``meshnode generate`` (by difference), the OpenAI API (by
  difference) and ``bench.route_bench``'s in-process initiator. Target: CLI decode >= 0.85 x best whole.
* **pinned** -- two machines simulated on one: each node under ``taskset`` on a core of its own, the
  initiator beside the head; the whole model on one core. Targets: single-session decode >= 0.92 x
  whole; 8 sessions' aggregate decode >= 1.7 x the whole model batched on one core; prefill of a
  2048-token prompt >= 1.5 x faster than the whole model.
* **batched** -- 8 concurrent sessions, unpinned: route aggregate decode >= 0.90 x the whole model
  batched at its best thread count.
* **bundles** -- 8 concurrent sessions through a route whose head sends the sessions' frames to the tail in
  bundles on one link (the default) and through one whose head sends each session on a stream of its own
  (``--no-link``), in turn, unpinned and pinned (a core per node): aggregate decode, and how many
  frames a link message carried (the tail's metrics); and one session's pinned decode through
  ``meshnode generate`` on each. Target (unpinned): route with links >= 0.90 x the whole
  model batched at its best thread count.
* **tls** -- what TLS costs: the pinned route's single-session decode through ``meshnode generate`` with
  TLS (the default) and with ``--insecure`` (nodes and client), the two routes measured in turn,
  ``--runs`` rounds. Target: with TLS >= 0.97 x without.
* **audit** -- what auditing costs (docs/security.md, "A hop that lies"): the pinned route with a replica of
  each hop (the head's replica on the tail's core and the other way round: a 2-core machine has no cores
  of their own for them), decode through ``meshnode generate`` in audited sessions (``--audit-rate 1``)
  and unaudited ones (``--audit-probation 0 --audit-rate 0``), in turn. No target: the figures are reported.
* **link** -- nodes on hosts of their own (network namespaces, bench/link_bench.py): link bytes per
  decoded token and decode tok/s with the tail's link free and limited by ``tc tbf``, f32 and f16 on
  the wire, beside what a serial model of compute plus bytes predicts. Needs root.
* **tracker** -- a real tracker's lookup and status latency and RSS, empty and holding its
  ``--max-entries`` of fresh keys (bench/tracker_bench.py). No target: the figures are reported.
* **memory** -- ``bench.memory_bench`` on the synthetic 1.3 GB model: half-range nodes <= 0.60 x the
  whole process's peak RSS, third-range nodes <= 0.45 x.

No figure here is asserted by a test; the targets are printed beside what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import paths

SECTIONS = ("one-machine", "pinned", "batched", "bundles", "tls", "audit", "link", "tracker", "memory")
#: copies of route_bench's paragraph in the prefill prompt: 2,055 tokens, just over 2,048
PREFILL_REPEAT = 26


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def pinned_here(cpus: set[int]) -> Iterator[None]:
    """Run this process (the in-process initiator) on ``cpus`` for the duration."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Report:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, what: str, route: float, whole: float, unit: str, target: float, *, ratio: float | None = None,
            at_most: bool = False, note: str = "") -> None:
        """One comparison; its ratio (default route / whole) must be >= ``target`` (``at_most``: <=)."""
        ratio = route / whole if ratio is None else ratio
        row = {"what": what, "route": route, "whole": whole, "unit": unit, "ratio": ratio,
               "target": f"{'<=' if at_most else '>='} {target}",
               "met": ratio <= target if at_most else ratio >= target, "note": note}
        self.rows.append(row)
        print(f"  -> {what}: route {route:.2f} {unit}, whole {whole:.2f} {unit}, ratio {ratio:.3f} "
              f"(target {row['target']}) {'met' if row['met'] else 'NOT MET'} {note}", flush=True)

    def print(self) -> None:
        print(f"\n{'comparison':<58}{'route':>10}{'whole':>10}{'ratio':>8}{'target':>9}  met")
        for r in self.rows:
            print(f"{r['what']:<58}{r['route']:>10.2f}{r['whole']:>10.2f}{r['ratio']:>8.3f}{r['target']:>9}"
                  f"  {'yes' if r['met'] else 'NO'}  {r['note']}")


def best_whole(model: Path, runs: int, tokens: int) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    by_t: dict[int, list[float]] = {t: [] for t in range(1, cores + 1)}
    tokens_seen: list[int] = []
    ids: list[int] = []
    for _ in range(runs):  # interleaved, so a busy moment of the host does not land on one thread count
        for t in by_t:
            r = paths.whole_decode(model, t, tokens)
            by_t[t].append(r["decode_tps"])
            tokens_seen, ids = r["short_tokens"], r["short_ids"]
    med = {t: statistics.median(v) for t, v in by_t.items()}
    best = max(med, key=lambda t: med[t])
    print("  whole model (Llama), decode tok/s by n_threads: "
          + ", ".join(f"{t}: {m:.1f} {[round(x, 1) for x in by_t[t]]}" for t, m in med.items())
          + f" -> best {best} threads", flush=True)
    return {"threads": best, "tps": med[best], "by_threads": med, "tokens": tokens_seen, "ids": ids}


def same_tokens(route: list[int], whole: list[int]) -> bool:
    """The route's generated tokens are the whole model's first ones (both start with the prompt's next token)."""
    return bool(route) and route == whole[: len(route)]


def one_machine(model: Path, runs: int, rep: Report) -> dict[str, Any]:
    from bench.route_bench import run_route
    from meshnode.runtime.launch import local_route

    print(f"\n== one machine: its cores shared by the route's nodes (load average {load()})", flush=True)
    whole = best_whole(model, runs, paths.LONG)
    with local_route(model, ["0:15", "15:30"], extra=["--ctx-size", "512"]) as nodes:
        peers = [n.endpoint for n in nodes]
        cli = paths.cli_decode(peers, runs)
        print(f"  route via `meshnode generate` (by difference of {paths.LONG} and {paths.SHORT} tokens): "
              f"{cli['tps']:.1f} tok/s {[round(x, 1) for x in cli['runs']]}; the CLI's own decode figure "
              f"{cli['reported_tps']:.1f}; tokens equal to the whole model's: "
              f"{same_tokens(cli['tokens'], whole['tokens'])}",
              flush=True)
        api = paths.api_decode(peers, runs)
        print(f"  route via the OpenAI API (by difference): {api['tps']:.1f} tok/s "
              f"{[round(x, 1) for x in api['runs']]}",
              flush=True)
        ids = whole["ids"]
        inproc = statistics.median(run_route(peers, ids, ids, paths.LONG)["decode_tps"] for _ in range(runs))
        print(f"  route via bench.route_bench's in-process initiator: {inproc:.1f} tok/s", flush=True)
    cores = len(os.sched_getaffinity(0))
    by_threads: dict[int, dict[str, Any]] = {}
    # every core for every decode step, and one thread for every step (the default until 2026-12-04:
    # a lone session's steps now take every core, docs/performance.md "One session on one machine")
    for threads in sorted({cores, 1}, reverse=True):
        with local_route(model, ["0:15", "15:30"], extra=["--ctx-size", "512", "--threads", str(threads)]) as nodes:
            by_threads[threads] = paths.cli_decode([n.endpoint for n in nodes], runs)
        print(f"  route with --threads {threads} on both nodes, via `meshnode generate`: "
              f"{by_threads[threads]['tps']:.1f} tok/s {[round(x, 1) for x in by_threads[threads]['runs']]}",
              flush=True)
    every = by_threads[cores]
    note = f"(whole at {whole['threads']} threads; nodes at their defaults)"
    rep.add("one machine: decode, `meshnode generate`", cli["tps"], whole["tps"], "tok/s", 0.85, note=note)
    rep.add("one machine: decode, OpenAI API", api["tps"], whole["tps"], "tok/s", 0.85, note=note)
    rep.add("one machine: decode, route_bench in-process", inproc, whole["tps"], "tok/s", 0.85, note=note)
    rep.add(f"one machine: decode, `meshnode generate`, --threads {cores}", every["tps"], whole["tps"], "tok/s", 0.85,
            note=f"(whole at {whole['threads']} threads)")
    if cores > 1:
        rep.add("one machine: decode, `meshnode generate`, --threads 1", by_threads[1]["tps"], whole["tps"], "tok/s",
                0.85, note=f"(whole at {whole['threads']} threads)")
    return {"whole": whole, "cli": cli, "api": api, "inproc_tps": inproc, "cli_all_threads": every,
            "cli_by_threads": by_threads, "load": load()}


def pinned(model: Path, runs: int, rep: Report) -> dict[str, Any]:
    from bench.batch_bench import run_route
    from meshnode.runtime.launch import local_route

    print(f"\n== several machines, simulated: one core per node, the whole model on one core (load average "
          f"{load()})", flush=True)
    text = paths.long_prompt(PREFILL_REPEAT)
    dec, pre, bat = [], [], []
    for _ in range(runs):
        dec.append(paths.whole_decode(model, 1, paths.LONG, cpus=[0])["decode_tps"])
        pre.append(paths.whole_prefill(model, PREFILL_REPEAT, 1, 2560, cpus=[0])["prefill_s"])
        b = paths.whole_batched(model, 8, 1, 64, cpus=[0])
        bat.append(b["tps"])
    w = {"decode_tps": statistics.median(dec), "prefill_s": statistics.median(pre),
         "batched_tps": statistics.median(bat)}
    print(f"  whole on core 0, 1 thread: decode {w['decode_tps']:.1f} tok/s, prefill {w['prefill_s']:.3f} s, "
          f"8 sessions batched {w['batched_tps']:.1f} tok/s", flush=True)
    extra = ["--ctx-size", "2560", "--max-sessions", "8"]
    with local_route(model, ["0:15", "15:30"], extra=extra, cpus=[[0], [1]]) as nodes:
        peers = [n.endpoint for n in nodes]
        cli = paths.cli_decode(peers, runs, cpus=[0])
        pres = [paths.generate(peers, text, 1, cpus=[0])[1] for _ in range(runs)]
        with pinned_here({0}):
            routes = [run_route(peers, b["ids"], [8], 64, warm=i == 0)["by_n"]["8"]["tps"] for i in range(runs)]
    r_pre = statistics.median(p["prefill_seconds"] for p in pres)
    n_pre = len(pres[0]["prompt_tokens"])
    print(f"  route, nodes on cores 0 and 1, initiator on core 0: decode {cli['tps']:.1f} tok/s "
          f"{[round(x, 1) for x in cli['runs']]}; prefill of {n_pre} tokens {r_pre:.3f} s; 8 sessions "
          f"{statistics.median(routes):.1f} tok/s {[round(x, 1) for x in routes]}", flush=True)
    note = "(whole: 1 thread on core 0; nodes: core 0 and core 1, default threads = 1)"
    rep.add("2 machines (pinned): decode, `meshnode generate`", cli["tps"], w["decode_tps"], "tok/s", 0.92,
            note=note)
    rep.add("2 machines (pinned): 8 sessions aggregate", statistics.median(routes), w["batched_tps"], "tok/s", 1.7,
            note=note)
    rep.add(f"2 machines (pinned): prefill {n_pre} tokens, whole/route", r_pre, w["prefill_s"], "s", 1.5,
            ratio=w["prefill_s"] / r_pre, note=note)
    return {"whole": w, "cli": cli, "route_prefill_s": r_pre, "route_batched": routes, "load": load()}


def in_turn(runs: int, *measures: Callable[[], list[float]]) -> list[list[float]]:
    """Each measure's figures over ``runs`` rounds, the measures taking turns within a round: the host's
    drift hits them alike."""
    out: list[list[float]] = [[] for _ in measures]
    for _ in range(runs):
        for got, measure in zip(out, measures, strict=True):
            got += measure()
    return out


def tls(model: Path, runs: int, rep: Report) -> dict[str, Any]:
    from meshnode.runtime.launch import local_route

    print(f"\n== TLS: the pinned route with TLS and with --insecure, in turn (load average {load()})", flush=True)
    extra = ["--ctx-size", "2560", "--max-sessions", "8"]
    with (local_route(model, ["0:15", "15:30"], extra=extra, cpus=[[0], [1]]) as tls_nodes,
          local_route(model, ["0:15", "15:30"], extra=[*extra, "--insecure"], cpus=[[0], [1]]) as plain_nodes):
        a, b = [n.endpoint for n in tls_nodes], [n.endpoint for n in plain_nodes]
        secure, plain = in_turn(runs, lambda: paths.cli_decode(a, 1, cpus=[0])["runs"],
                                lambda: paths.cli_decode(b, 1, cpus=[0], extra=["--insecure"])["runs"])
    s, p = statistics.median(secure), statistics.median(plain)
    print(f"  with TLS {s:.1f} tok/s {[round(x, 1) for x in secure]}; --insecure {p:.1f} tok/s "
          f"{[round(x, 1) for x in plain]}", flush=True)
    rep.add("TLS (pinned): decode with TLS / without", s, p, "tok/s", 0.97,
            note="(`meshnode generate`; nodes on cores 0 and 1; 'whole' = the same route with --insecure)")
    return {"tls_tps": secure, "insecure_tps": plain, "load": load()}


def audit(model: Path, runs: int, rep: Report) -> dict[str, Any]:
    from meshnode.runtime.launch import local_route

    print(f"\n== audit: the pinned route, audited and not, in turn (load average {load()})", flush=True)
    extra = ["--ctx-size", "2560", "--max-sessions", "8"]
    with (local_route(model, ["0:15", "15:30"], extra=extra, cpus=[[0], [1]]) as nodes,
          local_route(model, ["0:15", "15:30"], extra=extra, cpus=[[1], [0]]) as replicas):
        peers = [n.endpoint for n in nodes]
        spares = [a for r in replicas for a in ("--spare", r.endpoint)]
        audited, unaudited = ["--audit-rate", "1"], ["--audit-probation", "0", "--audit-rate", "0"]
        on, off = in_turn(runs, lambda: paths.cli_decode(peers, 1, cpus=[0], extra=[*spares, *audited])["runs"],
                          lambda: paths.cli_decode(peers, 1, cpus=[0], extra=[*spares, *unaudited])["runs"])
    a, u = statistics.median(on), statistics.median(off)
    print(f"  audited {a:.1f} tok/s {[round(x, 1) for x in on]}; not audited {u:.1f} tok/s "
          f"{[round(x, 1) for x in off]}", flush=True)
    rep.add("audit (pinned, replicas on the same 2 cores): decode audited / not", a, u, "tok/s", 0.0,
            note="(`meshnode generate`; 'whole' = the same route's unaudited sessions; no target)")
    return {"audited_tps": on, "unaudited_tps": off, "load": load()}


def batched(model: Path, runs: int, rep: Report) -> dict[str, Any]:
    from bench.batch_bench import run_route
    from meshnode.runtime.launch import local_route

    print(f"\n== 8 concurrent sessions, one machine, unpinned (load average {load()})", flush=True)
    cores = len(os.sched_getaffinity(0))
    runs_by_t = {t: [paths.whole_batched(model, 8, t, 64) for _ in range(runs)] for t in range(1, cores + 1)}
    by_t = {t: statistics.median(r["tps"] for r in rs) for t, rs in runs_by_t.items()}
    best = max(by_t, key=lambda t: by_t[t])
    ids = runs_by_t[best][0]["ids"]  # the prompts' ids, as the whole model tokenized them
    with local_route(model, ["0:15", "15:30"], extra=["--ctx-size", "512", "--max-sessions", "8"]) as nodes:
        peers = [n.endpoint for n in nodes]
        routes = [run_route(peers, ids, [8], 64, warm=i == 0)["by_n"]["8"]["tps"] for i in range(runs)]
    print(f"  whole batched, tok/s by n_threads: {', '.join(f'{t}: {v:.1f}' for t, v in by_t.items())}; "
          f"route {statistics.median(routes):.1f} {[round(x, 1) for x in routes]}", flush=True)
    rep.add("one machine: 8 sessions aggregate decode", statistics.median(routes), by_t[best], "tok/s", 0.90,
            note=f"(whole at {best} threads; nodes at their defaults)")
    return {"whole_by_threads": by_t, "route": routes, "load": load()}


def _link_counts(node: Any) -> tuple[float, float]:
    """The link messages and session frames ``node`` received (its --metrics)."""
    import re
    import urllib.request

    url = json.loads((node.state_dir / "node.json").read_text())["metrics"]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    got = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}
    return (got.get('meshnode_link_messages_total{direction="in"}', 0.0),
            got.get('meshnode_link_entries_total{direction="in"}', 0.0))


def bundles(model: Path, runs: int, rep: Report) -> dict[str, Any]:
    from bench.batch_bench import run_route
    from meshnode.runtime.launch import local_route

    print(f"\n== 8 sessions: frames bundled on a link, and a stream each (--no-link), in turn (load average "
          f"{load()})", flush=True)
    cores = len(os.sched_getaffinity(0))
    wholes = {t: statistics.median(paths.whole_batched(model, 8, t, 64)["tps"] for _ in range(runs))
              for t in range(1, cores + 1)}
    best = max(wholes, key=lambda t: wholes[t])
    ids = paths.whole_batched(model, 8, best, 4)["ids"]
    out: dict[str, Any] = {"whole_by_threads": wholes}
    extra = ["--ctx-size", "512", "--max-sessions", "8", "--metrics", "127.0.0.1:0"]
    for placement, cpus in (("unpinned", []), ("pinned", [[0], [1]])):
        with (local_route(model, ["0:15", "15:30"], extra=extra, cpus=cpus) as linked,
              local_route(model, ["0:15", "15:30"], extra=[*extra, "--no-link"], cpus=cpus) as separate):
            a, b = [n.endpoint for n in linked], [n.endpoint for n in separate]
            run_route(a, ids, [8], 4, warm=True)
            run_route(b, ids, [8], 4, warm=True)
            m0 = _link_counts(linked[1])
            with pinned_here({0}) if cpus else contextlib.nullcontext():
                on, off = in_turn(runs, lambda a=a: [run_route(a, ids, [8], 64)["by_n"]["8"]["tps"]],
                                  lambda b=b: [run_route(b, ids, [8], 64)["by_n"]["8"]["tps"]])
            m1 = _link_counts(linked[1])
        per = (m1[1] - m0[1]) / max(m1[0] - m0[0], 1.0)
        x, y = statistics.median(on), statistics.median(off)
        print(f"  {placement}: bundled {x:.1f} tok/s {[round(v, 1) for v in on]}; a stream each {y:.1f} tok/s "
              f"{[round(v, 1) for v in off]}; {per:.2f} session frames a link message", flush=True)
        rep.add(f"{placement}: 8 sessions, bundled / a stream each", x, y, "tok/s", 0.0,
                note=f"({per:.2f} frames a link message; no target)")
        out[placement] = {"bundled": on, "separate": off, "frames_per_message": per}
    with (local_route(model, ["0:15", "15:30"], extra=extra, cpus=[[0], [1]]) as linked,
          local_route(model, ["0:15", "15:30"], extra=[*extra, "--no-link"], cpus=[[0], [1]]) as separate):
        a, b = [n.endpoint for n in linked], [n.endpoint for n in separate]
        on, off = in_turn(runs, lambda: paths.cli_decode(a, 1, cpus=[0])["runs"],
                          lambda: paths.cli_decode(b, 1, cpus=[0])["runs"])
    print(f"  one session, pinned, `meshnode generate`: on a link {statistics.median(on):.1f} tok/s "
          f"{[round(v, 1) for v in on]}; a stream of its own {statistics.median(off):.1f} "
          f"{[round(v, 1) for v in off]}", flush=True)
    rep.add("pinned: one session's decode, on a link / a stream of its own", statistics.median(on),
            statistics.median(off), "tok/s", 0.0, note="(`meshnode generate`; no target)")
    out["single"] = {"link": on, "separate": off}
    rep.add("one machine: 8 sessions bundled, aggregate decode", statistics.median(out["unpinned"]["bundled"]),
            wholes[best], "tok/s", 0.90, note=f"(whole batched at {best} threads; nodes at their defaults)")
    out["load"] = load()
    return out


def memory(rep: Report) -> dict[str, Any]:
    from bench import memory_bench

    print(f"\n== memory: the synthetic 1.3 GB model (load average {load()})", flush=True)
    m = memory_bench.run(["--no-imports"])
    m["load"] = load()
    for row in m["rows"]:
        if row["target"] is not None:
            name = row["process"].removesuffix(" (meshnode serve)")
            rep.add(f"memory: {name} node {row['layers']}, peak RSS MB", row["peak_mb"], m["rows"][0]["peak_mb"],
                    "MB", row["target"], at_most=True, note=f"(both: {' '.join(m['node_flags'][:4])})")
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="repetitions of each measurement (medians reported)")
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeat)")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    ap.add_argument("--prefill-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ctx-size", type=int, default=2560, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.prefill_child:
        print(json.dumps(paths.prefill_child(ns.model, paths.long_prompt(ns.repeat), ns.threads, ns.ctx_size)))
        return 0
    from bench._setup import model_and_cuts

    model, _, _ = model_and_cuts(argparse.Namespace(model=None, cuts="0:15,15:30"))
    print(f"command: python -m bench {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"model: {model}; cores: {len(os.sched_getaffinity(0))}; load average at start: {load()}")
    rep, out = Report(), {}
    for name in ns.only or SECTIONS:
        if name == "memory":
            out[name] = memory(rep)
        else:
            from bench import link_bench, tracker_bench

            out[name] = {"one-machine": one_machine, "pinned": pinned, "batched": batched,
                         "tls": tls, "audit": audit, "bundles": bundles, "link": link_bench.run,
                         "tracker": tracker_bench.run}[name](model, ns.runs, rep)
    rep.print()
    print("load averages at each section's end: "
          + "; ".join(f"{k} {v.get('load', '?') if isinstance(v, dict) else '?'}" for k, v in out.items())
          + f"; now {load()}")
    if ns.json:
        print(json.dumps({"rows": rep.rows, "sections": out}, default=str))
    return 0
