"""The architectures meshnode cuts, each decision read in llama.cpp at the pinned build.

Paths are under llama.cpp's ``src/`` as vendored by llama-cpp-python 0.3.36
(``vendor/llama.cpp/src``). Generic facts every entry relies on:

* ``llama-graph.cpp`` ``build_inp_embd``: a batch of embeddings (``ubatch.embd``)
  enters through the same selection as token rows; the only scaling there is
  ``f_embedding_scale`` (granite family). What a graph does after it is in
  its own file.
* ``llama-model.cpp`` ``load_swa_pattern``: an explicit per-layer array under
  ``{arch}.attention.sliding_window_pattern`` wins over any default period.
* ``llama-model.cpp`` ``load_hparams``: per-layer values (``head_count``,
  ``head_count_kv``, ``feed_forward_length``, ``expert_feed_forward_length``,
  ``expert_used_count``) are read with ``get_key_or_arr`` over
  ``n_layer_all``, so a slice carries its layers' entries (slicer.py).
  ``n_layer() = n_layer_all - n_layer_nextn`` (llama-hparams.cpp): the
  next-token-prediction blocks at the end are not part of the trunk.
* Every graph here names the residual after layer ``il`` ``l_out-{il}``
  (``cb(cur, "l_out", il)``), where a non-tail range stops (native/capture.c).
"""

from __future__ import annotations

from typing import Any

from meshnode.gguf.arch import ArchPolicy, InputScale, Meta, Refused, Swa

# -- rules that are functions of the metadata -----------------------------------------


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


# -- the table -------------------------------------------------------------------------

_LLAMA_NOTE = ("embeddings enter layer 0 unchanged; every per-layer behaviour comes from per-layer tensors; "
               "experts (Mixtral) are per-layer tensors too")

_ENTRIES = [
    ArchPolicy("llama", "models/llama.cpp", families="Llama 2/3/3.1/3.2/3.3, Mistral 7B, Mixtral 8x7B/8x22B, "
               "SmolLM2, TinyLlama", note=_LLAMA_NOTE, test="tests/test_arch_parity.py"),
    ArchPolicy("qwen2", "models/qwen2.cpp", families="Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen",
               note="q/k/v biases are per-layer tensors", test="tests/test_arch_parity.py"),
    ArchPolicy("qwen3", "models/qwen3.cpp", families="Qwen3 0.6B-32B", note="q/k norms are per-layer tensors",
               test="tests/test_arch_parity.py"),
    ArchPolicy(
        "gemma3", "models/gemma3.cpp", input_scale=InputScale.TOKENS_SQRT_EMBD,
        swa=Swa(period=6), layer_count_dependent=frozenset({62}),
        families="Gemma 3 270M-27B",
        note="token input x sqrtf(n_embd), embeddings input not: the head scales its own lookup; local layers "
             "5 of every 6 (or the file's pattern) carried as explicit flags; 27B (62 layers) takes its "
             "attention scale from the layer count",
        test="tests/test_arch_parity.py"),
    ArchPolicy("qwen3moe", "models/qwen3moe.cpp", moe=True, families="Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder",
               note="router and experts are per-layer tensors; expert widths per layer via get_key_or_arr",
               test="tests/test_arch_moe.py"),
]

POLICIES: dict[str, ArchPolicy] = {p.arch: p for p in _ENTRIES}

#: architectures the pinned build loads that are refused for partial cuts, with the reason
REFUSED: dict[str, Refused] = {}
