"""Where a route's CPU goes, thread by thread: ``python -m bench.threadcost`` (issue 23, item 2).

Two ``meshnode serve`` halves on this machine; over one ``meshnode generate`` of ``--tokens`` greedy
tokens, each node's threads' CPU time (``/proc/PID/task/TID/stat``) and voluntary / involuntary context
switches (``.../status``) per decoded token, thread names from ``/proc`` (``comm``). A compute thread
switched out involuntarily mid-graph holds its partner at the next barrier: those counts are what to
read beside the CPU.

    python -m bench.threadcost [--model GGUF] [--tokens 136]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def snapshot(pid: int) -> dict[int, tuple[str, int, int, float]]:
    """tid -> (name, voluntary switches, involuntary switches, CPU seconds) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/status") as st, open(f"{base}/comm") as cm, open(f"{base}/stat") as sa:
                status, name, stat = st.read(), cm.read().strip(), sa.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out[int(tid)] = (name, int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]),
                         (int(stat[11]) + int(stat[12])) / TICK)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.threadcost", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the 1.34 GB synthetic model, bench.synth)")
    ap.add_argument("--tokens", type=int, default=136)
    ns = ap.parse_args(argv)
    from bench import paths
    from bench.synth import ensure_model
    from meshnode.runtime.launch import local_route

    model = Path(ns.model) if ns.model else ensure_model(1.0)
    cuts = paths.halves(model)
    with local_route(model, cuts) as nodes:
        peers = [x.endpoint for x in nodes]
        paths.generate(peers, paths.PROMPT, 4)  # warm-up
        before = {x.proc.pid: snapshot(x.proc.pid) for x in nodes}
        seconds, result = paths.generate(peers, paths.PROMPT, ns.tokens)
        after = {x.proc.pid: snapshot(x.proc.pid) for x in nodes}
    k = len(result["tokens"])
    print(f"{model.name}: {k} tokens in {seconds:.2f} s through `meshnode generate`; per token:")
    print("| node | thread (tid) | CPU ms | voluntary switches | involuntary switches |")
    print("|---|---|---|---|---|")
    for x, cut in zip(nodes, cuts, strict=True):
        for tid, (name, vol, invol, cpu) in after[x.proc.pid].items():
            if tid not in before[x.proc.pid]:
                continue
            _, vol0, invol0, cpu0 = before[x.proc.pid][tid]
            if vol > vol0 or invol > invol0:
                print(f"| {cut} | {name} ({tid}) | {(cpu - cpu0) * 1e3 / k:.2f} | {(vol - vol0) / k:.2f} | "
                      f"{(invol - invol0) / k:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
