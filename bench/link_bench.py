"""A route across hosts with a slow link: ``python -m bench --only link`` (needs root: bench/netlab.py).

Three hosts on a bridge (198.18.0.0/15): a head (layers 0:15, core 0), a tail (15:30, core 1) and a
client beside the head (core 0). For f32 and f16 on the wire: the bytes a decoded token moves over
the tail's link (both ways, counted by the kernel on its interface: residual, token, TLS, HTTP/2,
TCP/IP), then decode tok/s through ``meshnode generate`` (by difference) with the link free and with a
``tc tbf`` limit of ``RATE_MBIT`` both ways. A serial model predicts the limited rate: each token pays
its compute (1 / the free rate) plus its bytes at the link's rate,
``1 / (1/free + bytes_per_token / (rate / 8))``; both are printed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench import paths
from bench.netlab import Lab, available, lab
from meshnode.launch import start_node

#: the limited link's rate, megabits a second (f32's residual of SmolLM2 is 2.3 kB a token)
RATE_MBIT = 1.0
PORT = 7000


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _link_bytes(net: Lab, host: str) -> int:
    """Bytes the host's interface has sent and received so far."""
    total = 0
    for way in ("rx_bytes", "tx_bytes"):
        out = subprocess.run([*net.hosts[host].exec(), "cat", f"/sys/class/net/eth0/statistics/{way}"],
                             capture_output=True, text=True, check=True, timeout=30)
        total += int(out.stdout)
    return total


def _bytes_per_token(net: Lab, peers: list[str], extra: list[str], prefix: list[str]) -> float:
    """Link bytes per decoded token, by difference of a long and a short generation (start-up, prompt
    and tokenizer calls cancel out)."""
    counts = []
    for n in (paths.SHORT, paths.LONG):
        before = _link_bytes(net, "tail")
        _, out = paths.generate(peers, paths.PROMPT, n, [0], extra, prefix)
        counts.append((_link_bytes(net, "tail") - before, len(out["tokens"])))
    (b_short, t_short), (b_long, t_long) = counts
    return (b_long - b_short) / (t_long - t_short)


def run(model: Path, runs: int, rep: Any) -> dict[str, Any]:
    why = available()
    if why is not None:
        print(f"\n== link: skipped ({why})", flush=True)
        return {"skipped": why}
    print(f"\n== link: head and tail on hosts of their own, the tail's link free and at {RATE_MBIT:g} Mbit/s "
          f"(tc tbf), f32 and f16 on the wire (load average {_load()})", flush=True)
    out: dict[str, Any] = {}
    with lab("head", "tail", "client") as net:
        nodes = [start_node(model, layers, prefix=net.hosts[h].exec(), listen=f"{net.hosts[h].addr}:{PORT}",
                            cpus=[cpu], extra=["--max-sessions", "2"])
                 for h, layers, cpu in (("head", "0:15", 0), ("tail", "15:30", 1))]
        try:
            peers = [n.endpoint for n in nodes]
            client = net.hosts["client"].exec()
            for dtype in ("f32", "f16"):
                extra = ["--wire-dtype", dtype]
                per_token = _bytes_per_token(net, peers, extra, client)
                free = statistics.median(paths.cli_decode(peers, runs, [0], extra, client)["runs"])
                net.shape("tail", RATE_MBIT)
                try:
                    slow = statistics.median(paths.cli_decode(peers, runs, [0], extra, client)["runs"])
                finally:
                    net.unshape("tail")
                predicted = 1 / (1 / free + per_token / (RATE_MBIT * 1e6 / 8))
                print(f"  {dtype}: {per_token:.0f} link bytes a token; free link {free:.1f} tok/s; at "
                      f"{RATE_MBIT:g} Mbit/s {slow:.1f} tok/s (serial model predicts {predicted:.1f})", flush=True)
                rep.add(f"link ({dtype}): {RATE_MBIT:g} Mbit/s, measured / predicted", slow, predicted, "tok/s", 0.8,
                        note=f"({per_token:.0f} B/token; free link {free:.1f} tok/s)")
                out[dtype] = {"bytes_per_token": per_token, "free_tps": free, "limited_tps": slow,
                              "predicted_tps": predicted}
        finally:
            for n in nodes:
                n.stop()
    out["load"] = _load()
    return out
