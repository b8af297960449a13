"""How fast this machine computes a layer of a model, measured with llama.cpp before a node chooses
its range (``join --auto``; routing/sizing.py weighs it against what the mesh's nodes advertise).

One middle layer, then a few (``PROBE_LAYERS``, at most an eighth of the model), are cut into a
temporary directory (not the cache), loaded with a small context, and timed as every node times its
range at start (capabilities.measure_throughput): two decode times give a step's fixed cost and its
cost per layer, which predict this machine's time for a range as long as any peer's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from meshnode.capabilities import measure_throughput
from meshnode.executor._llama import LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.gguf import ensure_range

PROBE_LAYERS = 4


def probe_span(n_layer: int) -> tuple[int, int]:
    """The middle layers the probe runs (what a node with no copy fetches first)."""
    span = max(2, min(PROBE_LAYERS, n_layer // 8))
    start = max(1, n_layer // 2 - span // 2)
    return start, max(start, min(n_layer - 1, start + span))


def _decode_seconds(model: Path, start: int, end: int, root: Path) -> float:
    art = ensure_range(model, start, end, root=root)
    rng = LlamaRange(art, ExecConfig(n_ctx_per_session=256, max_sessions=1))
    try:
        tps = measure_throughput(rng).decode_tokens_per_second
    finally:
        rng.close()
    return 1.0 / tps if tps > 0 else 0.0


def step_time(model: Path, n_layer: int, layer_bytes: list[int]) -> tuple[float, float]:
    """(fixed seconds, seconds per weight byte) of a decode step of ``model`` on this machine, from
    timing one layer and ``probe_span``'s few (``layer_bytes``: each layer's weight bytes): a step's
    fixed cost and its cost per byte told apart, so a range of any size can be compared with what a
    peer advertises for its own. (0, 0) if it cannot say."""
    start, end = probe_span(n_layer)
    if end - start < 2:
        return 0.0, 0.0
    with tempfile.TemporaryDirectory(prefix="meshnode-probe-") as tmp:
        one = _decode_seconds(model, start, start + 1, Path(tmp))
        many = _decode_seconds(model, start, end, Path(tmp))
    first, rest = layer_bytes[start], sum(layer_bytes[start + 1 : end])
    if one <= 0 or many <= 0 or first <= 0 or rest <= 0:
        return 0.0, 0.0
    per = max((many - one) / rest, many / (first + rest) / 10)  # noise: never a negative slope
    return max(one - per * first, 0.0), per
