"""Mixture-of-experts and other llama-like families: qwen3moe, mixtral / llama31 (arch llama), qwen2moe,
mistral3, command-r, olmo2.

Each builder follows its ``src/models/<arch>.cpp`` ``load_arch_hparams`` /
``load_arch_tensors`` at the pinned build: the keys it reads (required ones at
least) and every tensor it creates, with its shape.
"""

from __future__ import annotations

import numpy as np

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


def _llama(t: Tiny, *, experts: bool, rope_freqs: bool) -> None:
    """models/llama.cpp: ``n_expert == 0`` -> ffn_gate/up/down, else ffn_gate_inp + ffn_*_exps of width
    ``n_ff`` (feed_forward_length; llama reads no expert_feed_forward_length); the graph takes the MoE
    branch when ``layers[il].ffn_gate_inp != nullptr``. ``rope_freqs.weight`` {n_rot/2}: created for
    layer 0, TENSOR_DUPLICATED for the others, used through ``get_rope_factors``."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-5)
    if experts:
        t.kv("expert_count", s.n_expert)
        t.kv("expert_used_count", s.n_expert_used)
    t.embeddings()
    if rope_freqs:
        # Llama 3.1's factors (convert_hf_to_gguf.py: 1 for high frequencies up to 8 for low ones)
        t.add("rope_freqs.weight", np.geomspace(1.0, 8.0, s.hd // 2).astype(np.float32))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p)
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        if experts:
            t.experts(p, s.n_ff)
        else:
            t.ffn(p)


@register("mixtral", arch="llama", n_ff=32, tied=False, rope_freq_base=1e6)
def build_mixtral(t: Tiny) -> None:
    """Mixtral: arch llama with ``llama.expert_count`` 8 / ``expert_used_count`` 2, untied output.weight."""
    _llama(t, experts=True, rope_freqs=False)


@register("llama31", arch="llama", tied=False, rope_freq_base=5e5)
def build_llama31(t: Tiny) -> None:
    """Llama 3.1: a dense llama with ``rope_freqs.weight`` (its rope scaling factors), untied output.weight."""
    _llama(t, experts=False, rope_freqs=True)


@register("qwen2moe", n_ff=64, rope_freq_base=1e6, tied=False)
def build_qwen2moe(t: Tiny) -> None:
    """models/qwen2moe.cpp: q/k/v biases, a router and 8 experts of expert_feed_forward_length, a shared
    expert of expert_shared_feed_forward_length with its sigmoid gate ffn_gate_inp_shexp {n_embd};
    output.weight required (flags 0)."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.moe_keys()
    t.kv("expert_shared_feed_forward_length", s.n_ff)
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p, bias=True)
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        t.experts(p)
        t.add(p + "ffn_gate_inp_shexp.weight", t.weight(1, s.n_embd)[0])
        t.ffn(p, s.n_ff, suffix="_shexp")


@register("mistral3", tied=False, rope_freq_base=1e6, ctx_train=4096, extra_kv={
    # Ministral 3's rope: yarn over an original context, and Llama 4's attention temperature
    # (log(floor(pos / n_ctx_orig_yarn) + 1) * scale + 1): a short original context puts the prompt's
    # later positions on a scale != 1
    "mistral3.rope.scaling.type": "yarn",
    "mistral3.rope.scaling.factor": 4.0,
    "mistral3.rope.scaling.original_context_length": 16,
    "mistral3.rope.scaling.yarn_beta_fast": 32.0,
    "mistral3.rope.scaling.yarn_beta_slow": 1.0,
    "mistral3.rope.scaling.yarn_log_multiplier": 1.0,
    "mistral3.attention.temperature_scale": 0.5,
})
def build_mistral3(t: Tiny) -> None:
    """models/mistral3.cpp: llama's tensors; temperature scale and yarn keys read in load_arch_hparams."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-5)
    t.kv("attention.key_length", s.hd)
    t.kv("attention.value_length", s.hd)
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p)
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        t.ffn(p)


@register("command-r", extra_kv={"command-r.logit_scale": 0.0625, "command-r.rope.scaling.type": "none"})
def build_command_r(t: Tiny) -> None:
    """models/command-r.cpp: LayerNorm (weight only, ``attention.layer_norm_epsilon``), one attn_norm per
    layer feeding attention and FFN in parallel, the lm_head always token_embd, ``logit_scale``; per-head
    LayerNorm q/k norms {n_embd_head_k, n_head} created only when ``n_layer >= 64`` (Command R+)."""
    s = t.spec
    t.kv("attention.layer_norm_epsilon", 1e-5)
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        if s.n_layer >= 64:
            t.add(p + "attn_q_norm.weight", t.norm(s.hd * s.n_head).reshape(s.n_head, s.hd), "F32")
            t.add(p + "attn_k_norm.weight", t.norm(s.hd * s.n_head_kv).reshape(s.n_head_kv, s.hd), "F32")
        t.attention(p)
        t.ffn(p)


@register("olmo2", tied=False, rope_freq_base=5e5)
def build_olmo2(t: Tiny) -> None:
    """models/olmo2.cpp: no pre-norms; q/k norms over the whole q {n_embd} / k {n_head_kv * n_embd_head};
    post_attention_norm and post_ffw_norm; output.weight required (flags 0). A window
    (``attention.sliding_window`` > 0, Olmo 3) comes through ``extra_kv``."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.embeddings()
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.attention(p)
        t.add(p + "attn_q_norm.weight", t.norm(s.n_embd))
        t.add(p + "attn_k_norm.weight", t.norm(s.n_head_kv * s.hd))
        t.add(p + "post_attention_norm.weight", t.norm(s.n_embd))
        t.ffn(p)
        t.add(p + "post_ffw_norm.weight", t.norm(s.n_embd))
