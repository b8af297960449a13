"""Graphs with windows, chunks and sinks: cohere2, gpt-oss, llama4."""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, Meta, Refused


def _llama4_boundaries(meta: Meta, arch: str, n_layer: int) -> dict[int, str]:
    """llama4.cpp: with ``sliding_window == 0`` the no-RoPE step is the slice's own layer count
    (``n_no_rope_layer_step = n_layer()``); else RoPE is skipped on every 4th layer
    (``(il + 1) % n_no_rope_layer_step``, default 4, llama-hparams.h) and MoE sits on every
    ``interleave_moe_layer_step``-th (``(il + 1) % n_moe_layer_step == 0``): both of the absolute
    index, with no per-layer key to carry them. A cut must keep both phases."""
    w = meta.get(f"{arch}.attention.sliding_window")
    if isinstance(w, int) and w == 0:
        why = ("llama4 without chunked attention skips RoPE on the last layer of whatever it loads "
               "(n_no_rope_layer_step = n_layer()), so a slice would skip it on its own last layer")
        return dict.fromkeys(range(1, n_layer), why)
    moe_step = int(meta.get(f"{arch}.interleave_moe_layer_step", 1) or 1)
    step = _lcm(4, moe_step)
    return {
        k: (f"llama4 skips RoPE on every 4th layer and puts experts on every {moe_step}th, counted from "
            f"layer 0 with no per-layer key to restate them: cuts must fall on multiples of {step}")
        for k in range(1, n_layer) if k % step
    }


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)



ENTRIES: list[ArchPolicy] = []

REFUSED: list[Refused] = []
