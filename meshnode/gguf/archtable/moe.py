"""Mixture-of-experts and other llama-like graphs: qwen3moe, qwen2moe, mistral3, command-r, olmo2."""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, Refused

ENTRIES = [
    ArchPolicy("qwen3moe", "models/qwen3moe.cpp", moe=True, families="Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder",
               note="router and experts are per-layer tensors; expert widths per layer via get_key_or_arr",
               test="tests/test_arch_moe.py"),
]

REFUSED: list[Refused] = []
