"""A route across hosts with a slow link: ``python -m bench --only link`` (needs root: bench/netlab.py).

Three hosts on a bridge (198.18.0.0/15): a head (layers 0:15, core 0), a tail (15:30, core 1) and a
client beside the head (core 0). For f32 and f16 on the wire: the bytes a decoded token moves over
the tail's link, in and out (counted by the kernel on its interface: residual, token, TLS, HTTP/2,
TCP/IP and ACKs), then decode tok/s through ``meshnode generate`` (by difference) with the link free
and limited both ways by ``tc tbf`` to each of ``RATES_MBIT``. Beside each, the bucket's bound: each
direction has a bucket of its own that refills at the rate while the hops compute, so a token costs the
link nothing until the bytes into the tail per second reach the rate: ``min(free, rate / 8 / in)``. (A
serial model, compute plus every byte at the rate, ``1 / (1/free + (in + out) / (rate / 8))``, is what a
link without a bucket would give; it is printed too.)
"""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench import paths
from bench.netlab import Lab, available, lab
from meshnode.runtime.launch import start_node

#: the limited link's rates, megabits a second (f32's residual of SmolLM2 is 2.3 kB a token): at 1 the bucket
#: refills between tokens, at 0.1 the rate binds
RATES_MBIT = (1.0, 0.1)
PORT = 7000


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _link_bytes(net: Lab, host: str) -> tuple[int, int]:
    """Bytes the host's interface has received and sent so far."""
    got = []
    for way in ("rx_bytes", "tx_bytes"):
        out = subprocess.run([*net.hosts[host].exec(), "cat", f"/sys/class/net/eth0/statistics/{way}"],
                             capture_output=True, text=True, check=True, timeout=30)
        got.append(int(out.stdout))
    return got[0], got[1]


def _bytes_per_token(net: Lab, peers: list[str], extra: list[str], prefix: list[str]) -> tuple[float, float]:
    """Link bytes per decoded token into and out of the tail, by difference of a long and a short generation
    (start-up, prompt and tokenizer calls cancel out)."""
    counts = []
    for n in (paths.SHORT, paths.LONG):
        rx0, tx0 = _link_bytes(net, "tail")
        _, out = paths.generate(peers, paths.PROMPT, n, [0], extra, prefix)
        rx1, tx1 = _link_bytes(net, "tail")
        counts.append((rx1 - rx0, tx1 - tx0, len(out["tokens"])))
    (rx_s, tx_s, t_s), (rx_l, tx_l, t_l) = counts
    return (rx_l - rx_s) / (t_l - t_s), (tx_l - tx_s) / (t_l - t_s)


def run(model: Path, runs: int, rep: Any) -> dict[str, Any]:
    why = available()
    if why is not None:
        print(f"\n== link: skipped ({why})", flush=True)
        return {"skipped": why}
    print(f"\n== link: head and tail on hosts of their own, the tail's link free and at "
          f"{' and '.join(f'{r:g}' for r in RATES_MBIT)} Mbit/s (tc tbf), f32 and f16 on the wire "
          f"(load average {_load()})", flush=True)
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
                rx, tx = _bytes_per_token(net, peers, extra, client)
                free = statistics.median(paths.cli_decode(peers, runs, [0], extra, client)["runs"])
                row: dict[str, Any] = {"bytes_in_per_token": rx, "bytes_out_per_token": tx, "free_tps": free}
                print(f"  {dtype}: {rx:.0f} B in + {tx:.0f} B out of the tail a token; free link {free:.1f} tok/s",
                      flush=True)
                for mbit in RATES_MBIT:
                    net.shape("tail", mbit)
                    try:
                        got = statistics.median(paths.cli_decode(peers, runs, [0], extra, client)["runs"])
                    finally:
                        net.unshape("tail")
                    bound = min(free, mbit * 1e6 / 8 / rx)
                    serial = 1 / (1 / free + (rx + tx) / (mbit * 1e6 / 8))
                    print(f"    at {mbit:g} Mbit/s (tbf): {got:.1f} tok/s; bucket bound {bound:.1f}, serial model "
                          f"{serial:.1f}", flush=True)
                    rep.add(f"link ({dtype}): {mbit:g} Mbit/s tbf, measured / bucket bound", got, bound, "tok/s", 0.8,
                            note=f"({rx:.0f}+{tx:.0f} B/token; free link {free:.1f}, serial model {serial:.1f} tok/s)")
                    row[f"tbf_{mbit:g}mbit_tps"], row[f"bound_{mbit:g}mbit_tps"] = got, bound
                out[dtype] = row
        finally:
            for n in nodes:
                n.stop()
    out["load"] = _load()
    return out
