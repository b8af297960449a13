"""Mixture-of-experts families: qwen3moe (more to come from the family owners)."""

from __future__ import annotations

from tests.tiny.core import Tiny, register


@register("qwen3moe", rope_freq_base=1e6, token_embd_type="F32")
def build_qwen3moe(t: Tiny) -> None:
    """models/qwen3moe.cpp: q/k norms, a router and 8 experts per layer, no shared expert."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.kv("attention.key_length", s.hd)
    t.kv("attention.value_length", s.hd)
    t.moe_keys()
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p)
        t.add(p + "attn_q_norm.weight", t.norm(s.hd))
        t.add(p + "attn_k_norm.weight", t.norm(s.hd))
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        t.experts(p)
