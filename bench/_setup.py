"""What the route benchmarks share: thread defaults, the model and its cuts, the header they print."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path


def thread_counts(ns: argparse.Namespace) -> tuple[int, int]:
    """``--threads`` / ``--threads-batch``, defaulting as llama-cpp-python does (cores/2, cores)."""
    cpus = len(os.sched_getaffinity(0)) or 1
    return ns.threads or max(cpus // 2, 1), ns.threads_batch or cpus


def model_and_cuts(ns: argparse.Namespace) -> tuple[Path, int, list[str]]:
    """``--model`` (default: pulled and verified), its layer count, and ``--cuts`` (default: two halves),
    each range cut here, so no node's peak RSS includes cutting its artifact."""
    from meshnode.gguf import ensure_range, inspect_model
    from meshnode.models import pull

    model = Path(ns.model) if ns.model else pull()
    n_layer = inspect_model(model).n_layer
    cuts = ns.cuts.split(",") if ns.cuts else [f"0:{n_layer // 2}", f"{n_layer // 2}:{n_layer}"]
    for c in cuts:
        a, b = c.split(":")
        ensure_range(model, int(a), int(b))
    return model, n_layer, cuts


def print_header(name: str, argv: list[str] | None, model: Path, n_layer: int, cuts: list[str], threads: int,
                 threads_batch: int, extra: list[str]) -> None:
    print(f"command: python -m bench.{name} {shlex.join(sys.argv[1:] if argv is None else argv)}")
    print(f"model: {model}  ({n_layer} layers)  cuts: {','.join(cuts)}  cores: {os.cpu_count() or 1}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other processes skew timings)")
    print(f"threads: n_threads={threads} n_threads_batch={threads_batch} (both sides); node flags: {shlex.join(extra)}")
