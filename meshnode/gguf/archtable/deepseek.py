"""Leading dense blocks, MLA and next-token-prediction blocks: deepseek2, glm4moe."""

from __future__ import annotations

from typing import Any

from meshnode.gguf.arch import ArchPolicy, Meta, Refused


def _deepseek2_lite(meta: Meta, arch: str, n_layer: int) -> bool:
    """deepseek2.cpp ``load_arch_hparams``: ``is_lite`` from the layer count (and vocabulary size)."""
    return n_layer in (26, 27) or (n_layer == 48 and _n_vocab(meta, arch) == 128256)


def _n_vocab(meta: Meta, arch: str) -> int:
    v = meta.get(f"{arch}.vocab_size")
    if isinstance(v, int):
        return v
    toks = meta.get("tokenizer.ggml.tokens")
    return len(toks) if isinstance(toks, list) else 0


def _deepseek2_range(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> str | None:
    n = end - start
    if not _deepseek2_lite(meta, arch, n_layer) and n in (26, 27, 48):
        return (f"a {n}-layer deepseek2 slice is taken for a 'lite' model (is_lite from the layer count in "
                "deepseek2.cpp), which skips q_lora_rank and loads other attention tensors")
    return None


def _deepseek2_kv(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> dict[str, Any]:
    """What deepseek2.cpp derives from the whole model's layer count, stated in the slice."""
    put: dict[str, Any] = {}
    if f"{arch}.attention.q_lora_rank" not in meta:
        put[f"{arch}.attention.q_lora_rank"] = 0  # a lite model: n_lora_q stays 0, so wq (not wq_a/wq_b)
    if not meta.get(f"{arch}.expert_gating_func"):
        glm_lite = n_layer in (47, 48) and _n_vocab(meta, arch) == 154880
        put[f"{arch}.expert_gating_func"] = 2 if glm_lite else 1  # SIGMOID : SOFTMAX (llama-hparams.h)
    return put



ENTRIES: list[ArchPolicy] = []

REFUSED: list[Refused] = []
