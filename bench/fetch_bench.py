"""What a joining node's fetch costs the sessions of the nodes it fetches from: ``python -m bench.fetch_bench``.

Two nodes serve the halves of the 1.34 GB synthetic model (one machine, defaults, on a tracker); each
round measures a greedy decode through ``meshnode generate`` (by difference of 8 and 136 tokens) alone,
then again while a third node joins with no copy (``join --mesh ID --layers 16:24``, an empty cache)
and fetches its range from the two at their ``--share-rate`` (default 64 MiB/s each); the ratio of the
two decode rates per round, and their median. Also printed: how long the join took and how many bytes
came from whom.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from bench import paths, synth
    from meshnode.gguf.model import fingerprint
    from meshnode.runtime.launch import NodeProcess, start_node
    from tests.test_tracker import _start_tracker, _stop

    ap = argparse.ArgumentParser(prog="python -m bench.fetch_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--share-rate", default="64", help="MiB/s each serving node sends (its --share-rate)")
    ns = ap.parse_args(argv)
    model = synth.ensure_model(1.0)
    print(f"command: python -m bench.fetch_bench {' '.join(sys.argv[1:] if argv is None else argv)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_tracker(Path(tmp) / "t.sqlite", ttl=10)
        nodes = [start_node(model, c, command="join", extra=("--tracker", url, "--heartbeat", "1",
                                                             "--share-rate", ns.share_rate))
                 for c in ("0:12", "12:24")]
        try:
            peers = [n.endpoint for n in nodes]
            paths.generate(peers, paths.PROMPT, 4)
            time.sleep(2)
            ratios = []
            for i in range(ns.rounds):
                ts, s = paths.generate(peers, paths.PROMPT, 8)
                tl, lg = paths.generate(peers, paths.PROMPT, 136)
                alone = (len(lg["tokens"]) - len(s["tokens"])) / (tl - ts)
                joined: list[NodeProcess] = []
                took: list[float] = []

                def join(cache: str, joined: list[NodeProcess], took: list[float]) -> None:
                    t0 = time.monotonic()
                    joined.append(start_node(None, "16:24", command="join", timeout=900,
                                             env={"MESHNODE_CACHE_DIR": cache},
                                             extra=("--mesh", fingerprint(model)[:16], "--tracker", url)))
                    took.append(time.monotonic() - t0)

                t = threading.Thread(target=join, args=(f"{tmp}/cache{i}", joined, took))
                t.start()
                time.sleep(1.5)  # the fetch under way (the join's own start-up and lookup come first)
                ts, s = paths.generate(peers, paths.PROMPT, 8)
                tl, lg = paths.generate(peers, paths.PROMPT, 136)
                during = (len(lg["tokens"]) - len(s["tokens"])) / (tl - ts)
                t.join()
                line = next((x for x in joined[0].stderr().splitlines() if "fetched" in x), "") if joined else ""
                for n in joined:
                    n.stop()
                ratios.append(during / alone)
                print(f"  round {i + 1}: decode alone {alone:.2f} tok/s, while a node fetches {during:.2f} tok/s "
                      f"(ratio {during / alone:.3f}); the join took {took[0] if took else float('nan'):.1f} s: "
                      f"{line.removeprefix('meshnode: ')}", flush=True)
            print(f"median ratio {statistics.median(ratios):.3f}")
        finally:
            for n in nodes:
                n.stop()
            _stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
