"""Drafting over slow links: ``python -m bench.wan_bench`` (issue 23, item 4).

Two ``meshnode serve`` halves on 127.0.0.1; the tail behind ``bench.delayproxy`` at 0, 5, 20 and 50 ms
one way (this kernel has no netem), the initiator beside the head, as a route of two machines over a
WAN. For each delay and each task -- a copy task (a paragraph, then "Copy:") and free text (a short
story) -- ``meshnode generate`` without drafting and with ``--draft ngram``, in turn for ``--rounds``
rounds; decode tok/s as the CLI reports it (after prefill), the median over rounds, and whether the
texts are identical.

Beside the figures, the model of a token's time (docs/performance.md, "Over slow links"): without
drafting a token costs compute ``c`` plus one round trip across the hop boundary, ``t = c + 2 d``; with
drafting a round yields ``r`` tokens (accepted drafts + 1) for one round trip, and each token costs its
own compute plus the rejected positions' share ``c'``: ``t = c' + 2 d / r``. ``c`` and ``c'`` are the
measured per-token times at 0 ms; ``r`` is measured at each delay.

Reproduce: ``.venv/bin/python -m bench.wan_bench`` (``--delays 0,20``, ``--tokens 96``, ``--rounds 3``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASKS = {
    "copy": ("Copy this paragraph exactly.\nParagraph: The lighthouse keeper climbed the narrow stairs every "
             "evening at dusk, lit the great lamp, and watched the ships pass safely beyond the rocks until "
             "morning came over the grey and quiet sea. In winter the storms were long and the nights were cold, "
             "but he never missed a single evening, and the sailors in the harbour town knew his light as well "
             "as they knew their own homes. When he grew old, his daughter carried the oil up the stairs for him, "
             "and in time she learned to trim the wick, to clean the lens, and to read the weather in the colour "
             "of the clouds before the wind arrived.\nCopy: The lighthouse keeper"),
    "free": "Once upon a time, in a small town by the sea, there lived a robot who",
}


@contextlib.contextmanager
def delayed(target: str, delay_ms: float) -> Iterator[str]:
    """``bench.delayproxy`` in front of ``target``; yields its address."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.delayproxy", target, str(delay_ms)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        m = re.search(r"listening on (\S+)", proc.stdout.readline())
        if not m:
            raise RuntimeError("bench.delayproxy did not start")
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(10)


def generate(peers: list[str], prompt: str, tokens: int, *extra: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshnode-gen-") as state:
        done = subprocess.run([sys.executable, "-m", "meshnode", "generate", *[a for p in peers for a in ("--peer", p)],
                               "--prompt", prompt, "--max-tokens", str(tokens), "--json", *extra], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "XDG_STATE_HOME": state})
    if done.returncode != 0:
        raise RuntimeError(f"meshnode generate failed: {done.stderr[-800:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def per_round(r: dict[str, Any]) -> float:
    """Tokens a round yields: draft rounds give accepted + 1, plain steps 1 (the first token is prefill's)."""
    d = r["draft"]
    n = len(r["tokens"]) - 1
    if not d:
        return 1.0
    rounds = d["steps"] + (n - d["steps"] - d["accepted"])
    return n / rounds if rounds else 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wan_bench", allow_abbrev=False,
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the default model)")
    ap.add_argument("--delays", default="0,5,20,50", help="one-way delays in ms, comma-separated")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from meshnode.gguf import inspect_model
    from meshnode.models import pull
    from meshnode.runtime.launch import local_route

    model = Path(ns.model) if ns.model else pull()
    n_layer = inspect_model(model).n_layer
    cuts = [f"0:{n_layer // 2}", f"{n_layer // 2}:{n_layer}"]
    delays = [float(x) for x in ns.delays.split(",")]
    print(f"command: python -m bench.wan_bench {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"model {model.name}, cuts {','.join(cuts)}, tail behind a delay proxy, initiator beside the head; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    with local_route(model, cuts) as nodes:
        head, tail = nodes[0].endpoint, nodes[1].endpoint
        for delay in delays:
            with delayed(tail, delay) as proxy:
                peers = [head, proxy]
                generate(peers, "Hello", 4)  # warm-up: the link through the proxy is up
                for task, prompt in TASKS.items():
                    plain, draft, same, r = [], [], True, []
                    for _ in range(ns.rounds):
                        a = generate(peers, prompt, ns.tokens)
                        b = generate(peers, prompt, ns.tokens, "--draft", "ngram", "--draft-max", str(ns.draft_max))
                        plain.append(a["decode_tokens_per_second"])
                        draft.append(b["decode_tokens_per_second"])
                        same = same and a["tokens"] == b["tokens"]
                        r.append(per_round(b))
                    row = {"delay_ms": delay, "task": task, "plain_tps": statistics.median(plain),
                           "draft_tps": statistics.median(draft), "speedup": statistics.median(
                               x / y for x, y in zip(draft, plain, strict=True)), "same_text": same,
                           "tokens_per_round": statistics.median(r), "plain_runs": plain, "draft_runs": draft}
                    rows.append(row)
                    print(f"  {delay:4.0f} ms  {task:<5}  without {row['plain_tps']:6.1f} tok/s  with drafting "
                          f"{row['draft_tps']:6.1f} tok/s  x{row['speedup']:.2f}  ({row['tokens_per_round']:.2f} "
                          f"tokens a round; same text: {same})", flush=True)
    print("\nthe model of a token's time (ms): without drafting c + 2d; with drafting c' + 2d / r")
    for task in TASKS:
        base = next((x for x in rows if x["task"] == task and x["delay_ms"] == 0), None)
        if base is None:
            continue
        c, c2 = 1000 / base["plain_tps"], 1000 / base["draft_tps"]
        for x in (x for x in rows if x["task"] == task):
            d = x["delay_ms"]
            p_plain, p_draft = c + 2 * d, c2 + 2 * d / x["tokens_per_round"]
            x["model_plain_ms"], x["model_draft_ms"] = p_plain, p_draft
            print(f"  {task:<5} {d:4.0f} ms: without {1000 / x['plain_tps']:6.1f} measured, {p_plain:6.1f} modelled;"
                  f" with {1000 / x['draft_tps']:6.1f} measured, {p_draft:6.1f} modelled (c {c:.1f}, c' {c2:.1f}, "
                  f"r {x['tokens_per_round']:.2f})")
    if ns.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
