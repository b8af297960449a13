"""Kill-to-next-token: ``python -m bench.failover [--runs 3]``.

A three-hop loopback route of ``meshnode serve`` processes (0:7, 7:19, 19:30) plus one spare for the
victim's range. ``meshnode generate --spare ... --stream --json`` runs as its own process; after
``--kill-after`` streamed tokens this script SIGKILLs the head, a middle or the tail and measures,
on its own clock, the time from the kill to the next token line the initiator prints. Also shown:
what the initiator reports (failure seen -> route whole again, failure seen -> next token, positions
replayed), the steady decode gap between tokens before the kill (the baseline beside the figure),
and whether the final tokens equal an uninterrupted run on the same route. Target: kill to next
token < 2 s on loopback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from meshnode.models import pull
from meshnode.runtime.launch import NodeProcess, start_node

PROMPT = "The three primary colors are"
ROUTE = ("0:7", "7:19", "19:30")
ROLES = ("head", "middle", "tail")


def _run(cmd: list[str], victim: NodeProcess | None, kill_after: int) -> dict[str, Any]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    stamps: list[float] = []
    killed_at = None
    lines: list[dict[str, Any]] = []
    for line in proc.stdout:
        stamps.append(time.perf_counter())
        lines.append(json.loads(line))
        if victim is not None and len(lines) == kill_after:
            victim.proc.send_signal(signal.SIGKILL)
            killed_at = time.perf_counter()
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"generate failed: {err}")
    out: dict[str, Any] = {"result": lines[-1], "stamps": stamps[:-1]}
    if killed_at is not None:
        after = [t for t in stamps[:-1] if t > killed_at]
        out["kill_to_next_token"] = after[0] - killed_at if after else None
        gaps = [b - a for a, b in itertools.pairwise(stamps[1:kill_after])]
        out["decode_gap_before"] = statistics.median(gaps) if gaps else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kill-after", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = pull()
    rows: dict[str, list[dict[str, Any]]] = {r: [] for r in ROLES}
    baseline_tokens = None
    for _ in range(args.runs):
        for victim_idx, role in enumerate(ROLES):
            nodes = [start_node(model, c) for c in ROUTE]
            spare = start_node(model, ROUTE[victim_idx])
            try:
                peers = [a for n in nodes for a in ("--peer", n.endpoint)]
                cmd = [sys.executable, "-m", "meshnode", "generate", *peers, "--spare", spare.endpoint,
                       "--prompt", PROMPT, "--max-tokens", str(args.tokens),
                       "--stream", "--json"]
                if baseline_tokens is None:
                    baseline_tokens = _run(cmd, None, 0)["result"]["tokens"]
                r = _run(cmd, nodes[victim_idx], args.kill_after)
                (f,) = r["result"]["failovers"]
                rows[role].append({"kill_to_next_token": r["kill_to_next_token"],
                                   "decode_gap_before": r["decode_gap_before"],
                                   "recovery_seconds": f["recovery_seconds"],
                                   "seen_to_next_token": f["seconds_to_next_token"],
                                   "replayed_positions": f["replayed_positions"],
                                   "tokens_equal": r["result"]["tokens"] == baseline_tokens})
            finally:
                for n in (*nodes, spare):
                    n.stop()
    print(f"kill-to-next-token, 3-hop loopback route, {args.runs} run(s) each, median (kill after token "
          f"{args.kill_after} of {args.tokens}):")
    print(f"{'victim':8} {'kill->next':>11} {'decode gap':>11} {'seen->whole':>12} {'seen->next':>11} "
          f"{'replayed':>9} {'same tokens':>12}")
    summary: dict[str, Any] = {}
    for role, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in
               ("kill_to_next_token", "decode_gap_before", "recovery_seconds", "seen_to_next_token",
                "replayed_positions")}
        same = all(x["tokens_equal"] for x in rs)
        summary[role] = {**med, "tokens_equal": same, "runs": rs}
        print(f"{role:8} {med['kill_to_next_token']:10.3f}s {med['decode_gap_before']:10.3f}s "
              f"{med['recovery_seconds']:11.3f}s {med['seen_to_next_token']:10.3f}s "
              f"{med['replayed_positions']:9.0f} {same!s:>12}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
