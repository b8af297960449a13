"""Graphs that scale their input, or fuse their projections: granite, granitemoe, gemma2, phi3.

Each builder follows ``load_arch_hparams`` / ``load_arch_tensors`` of
``src/models/<file>.cpp`` at the pinned build (llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import numpy as np

from tests.tiny.core import Tiny, register


def _rope_factors(t: Tiny, n: int) -> np.ndarray:
    """Per-frequency rope divisors around 1 (LongRoPE's factors, llama3's rope_freqs)."""
    return np.float32(1.0) + np.abs(t.rng.standard_normal(n, dtype=np.float32))


def _granite_keys(t: Tiny) -> None:
    """granite.cpp / granite-moe.cpp ``load_arch_hparams``: logit_scale is required, the rest optional.

    Values near Granite 3.x's (embedding 12, residual 0.22, logit 8), so every scale matters."""
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.kv("logit_scale", 8.0)
    t.kv("residual_scale", 0.22)
    t.kv("embedding_scale", 12.0)
    t.kv("attention.scale", 0.09)


def _granite_layer(t: Tiny, p: str) -> None:
    s = t.spec
    t.add(p + "attn_norm.weight", t.norm(s.n_embd))
    t.attention(p)
    t.add(p + "attn_output.bias", t.bias(s.n_embd))  # optional wo_b
    t.add(p + "ffn_norm.weight", t.norm(s.n_embd))


@register("granite", tied=False, token_embd_type="F32")
def build_granite(t: Tiny) -> None:
    """models/granite.cpp: dense SwiGLU with optional biases, an untied lm_head, a global
    ``rope_freqs`` (not LongRoPE: ``rope_scaling_type_train`` is linear), rope on (rope.scaling.finetuned
    absent: ``rope_finetuned = true``), no deepstack mapping (text-only)."""
    s = t.spec
    _granite_keys(t)
    t.embeddings()
    t.add("rope_freqs.weight", _rope_factors(t, s.hd // 2))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        _granite_layer(t, p)
        t.ffn(p)
        t.add(p + "ffn_up.bias", t.bias(s.n_ff))
        t.add(p + "ffn_down.bias", t.bias(s.n_embd))


@register("granitemoe", n_ff=32, token_embd_type="Q8_0")
def build_granitemoe(t: Tiny) -> None:
    """models/granite-moe.cpp: the granite graph with experts of width ``feed_forward_length`` (the
    loader's ``n_ff``, not ``expert_feed_forward_length``) and a shared expert of width
    ``expert_shared_feed_forward_length`` (Granite MoE Shared)."""
    s = t.spec
    _granite_keys(t)
    t.kv("expert_count", s.n_expert)
    t.kv("expert_used_count", s.n_expert_used)
    n_shexp = 48
    t.kv("expert_shared_feed_forward_length", n_shexp)
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        _granite_layer(t, p)
        t.experts(p, s.n_ff)
        t.ffn(p, n_shexp, suffix="_shexp")


@register("gemma2", n_embd=96, head_dim=32, n_ff=192, rope_freq_base=10000.0)
def build_gemma2(t: Tiny) -> None:
    """models/gemma2.cpp: input x sqrtf(n_embd) (96: not exact in float32), local layers 0, 2, 4 (the
    default ``load_swa_pattern(ml, 2)``) with a window of 8 and their own rope base, attention and final
    logit softcapping, post-attention and post-FFN norms, GELU, key_length 32 != n_embd / n_head, and the
    lm_head always ``token_embd`` (no ``output.weight``)."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.kv("attention.key_length", s.hd)
    t.kv("attention.value_length", s.hd)
    t.kv("attention.sliding_window", 8)
    t.kv("rope.freq_base_swa", 1000.0)
    t.kv("attn_logit_softcapping", 2.0)
    t.kv("final_logit_softcapping", 5.0)
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p)
        t.add(p + "post_attention_norm.weight", t.norm(s.n_embd))
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        t.ffn(p)
        t.add(p + "post_ffw_norm.weight", t.norm(s.n_embd))


@register("phi3", tied=False)
def build_phi3(t: Tiny) -> None:
    """models/phi3.cpp: fused ``attn_qkv`` ({n_embd, n_embd + 2 n_embd_gqa}), fused gate+up in ``ffn_up``
    ({n_embd, 2 n_ff}, SWIGLU over the halves), LongRoPE ``rope_factors_long``/``_short`` (global, one
    pair), an untied lm_head, and a declared sliding window that the loader switches off.

    ``rope.scaling.original_context_length`` 256 is below every context the tests run at (512 for
    ``Llama``, 2048 for meshnode's ranges): ``get_rope_factors`` picks the long factors; pass
    ``extra_kv={"phi3.rope.scaling.original_context_length": 2048}`` for the short ones.
    ``extra_kv={"phi3.rope.dimension_count": n}`` rotates only n of each head's dimensions (Phi-4-mini's
    partial rotary); the factors follow (``{n_rot/2}``)."""
    s = t.spec
    n_rot = int(s.extra_kv.get("phi3.rope.dimension_count", s.hd))
    # llama-vocab.cpp gives "<|end|>" & co. rstrip attributes (token_to_id.at) when general.name contains
    # "phi3" or "phi-3": the donor's vocabulary has none of them
    t.put("general.name", f"tiny-p-3-{s.n_layer}L-s{s.seed}")
    t.kv("attention.layer_norm_rms_epsilon", 1e-5)
    t.kv("rope.dimension_count", n_rot)
    t.kv("attention.sliding_window", 8)  # Phi-3-mini-4k declares 2047: the loader sets swa_type NONE
    t.kv("rope.scaling.original_context_length", 256)
    t.kv("rope.scaling.attn_factor", 1.19)
    t.embeddings()
    t.add("rope_factors_long.weight", _rope_factors(t, n_rot // 2))
    t.add("rope_factors_short.weight", _rope_factors(t, n_rot // 2))
    q_dim, kv_dim = s.hd * s.n_head, s.hd * s.n_head_kv
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.add(p + "attn_qkv.weight", t.weight(q_dim + 2 * kv_dim, s.n_embd))
        t.add(p + "attn_output.weight", t.weight(s.n_embd, q_dim))
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        t.add(p + "ffn_up.weight", t.weight(2 * s.n_ff, s.n_embd))
        t.add(p + "ffn_down.weight", t.weight(s.n_embd, s.n_ff))
