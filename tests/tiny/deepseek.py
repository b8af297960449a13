"""Leading dense blocks, MLA and next-token-prediction blocks: deepseek2, glm4moe.

Both put ``leading_dense_block_count`` dense FFN blocks first and MoE blocks
with a shared expert after, and may append ``nextn_predict_layers``
next-token-prediction (MTP) blocks after the trunk: ``block_count`` counts
them, ``n_layer() = n_layer_all - n_layer_nextn`` (llama-hparams.cpp) does not.
An MTP block holds a whole MoE block's tensors plus ``nextn.eh_proj``,
``nextn.enorm``, ``nextn.hnorm`` (required) and ``nextn.shared_head_norm``
(optional), as ``load_arch_tensors`` creates them for ``i >= n_layer``.
"""

from __future__ import annotations

from tests.tiny.core import Tiny, register

#: deepseek2 MLA widths of the tiny models (DeepSeek-V3: 1536, 512, 128, 64, 128)
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 32, 32, 16, 8, 16


def _nextn(t: Tiny, p: str) -> None:
    """The MTP-only tensors of a next-token-prediction block (its trunk-like tensors come first)."""
    n_embd = t.spec.n_embd
    t.add(p + "nextn.eh_proj.weight", t.weight(n_embd, 2 * n_embd))
    t.add(p + "nextn.enorm.weight", t.norm(n_embd))
    t.add(p + "nextn.hnorm.weight", t.norm(n_embd))
    t.add(p + "nextn.shared_head_norm.weight", t.norm(n_embd))


def _moe_with_shared(t: Tiny, p: str, *, probs_bias: bool) -> None:
    """Router, 8 routed experts, the selection bias (``exp_probs_b``) and one shared expert."""
    s = t.spec
    t.experts(p)
    if probs_bias:
        t.add(p + "exp_probs_b.bias", t.bias(s.n_expert))
    t.ffn(p, s.n_ff_exp, suffix="_shexp")  # n_ff_exp * expert_shared_count (1)


@register("deepseek2", n_head_kv=1, token_embd_type="F32", tied=False)
def build_deepseek2(t: Tiny) -> None:
    """DeepSeek-V3/R1/Kimi-K2-like: ``q_lora_rank``, 2 leading dense blocks, one MTP block, untied."""
    _deepseek2(t, lite=False, dense_lead=2, nextn=1)


@register("deepseek2-lite", arch="deepseek2", n_layer=27, n_head_kv=1, token_embd_type="F32")
def build_deepseek2_lite(t: Tiny) -> None:
    """DeepSeek-V2-Lite-like: 27 layers (llama.cpp's ``is_lite``), no ``q_lora_rank`` key, 1 dense block."""
    _deepseek2(t, lite=True, dense_lead=1, nextn=0)


@register("deepseek2-wq", arch="deepseek2", n_head_kv=1, token_embd_type="F32", seed=1)
def build_deepseek2_wq(t: Tiny) -> None:
    """The lite graph path (``attn_q``, ``n_lora_q == 0``) in a 6-layer model, which llama.cpp does
    not take for lite: ``q_lora_rank = 0`` stated, 1 dense block, no MTP block; with Mistral-Large's
    attention temperature (a scale of the position, ``llm_graph_input_attn_temp``, floor every 8)."""
    _deepseek2(t, lite=True, dense_lead=1, nextn=0)
    t.kv("attention.q_lora_rank", 0)
    t.kv("attention.temperature_scale", 0.1)
    t.kv("attention.temperature_length", 8)


def _deepseek2(t: Tiny, *, lite: bool, dense_lead: int, nextn: int) -> None:
    """models/deepseek2.cpp, MLA with the split ``attn_k_b``/``attn_v_b`` tensors (``is_mla()``).

    ``lite``: no ``q_lora_rank``, so ``attn_q`` instead of ``attn_q_a``/``attn_q_a_norm``/
    ``attn_q_b``; llama.cpp takes a model for lite from its layer count alone (26 or 27
    layers, or 48 with a 128256-token vocabulary), so a lite tiny model has 27.

    The non-lite model is DeepSeek-V3/R1/Kimi-K2-like: sigmoid gating with ``exp_probs_b``,
    normalized and scaled expert weights, expert groups, YaRN with ``yarn_log_multiplier``.
    The lite one is DeepSeek-V2-Lite-like: no ``expert_gating_func`` key (softmax, chosen
    from the layer count and vocabulary size in ``load_arch_hparams``), no bias, no YaRN.
    """
    s = t.spec
    n_head, n_embd = s.n_head, s.n_embd
    k_mla = QK_NOPE + QK_ROPE
    t.kv("block_count", s.n_layer + nextn)
    if nextn:
        t.kv("nextn_predict_layers", nextn)
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.kv("leading_dense_block_count", dense_lead)
    if not lite:
        t.kv("attention.q_lora_rank", Q_LORA)
    t.kv("attention.kv_lora_rank", KV_LORA)
    # the cache holds the compressed kv (MQA, one kv head): key = kv_lora + rope, value = kv_lora
    t.kv("attention.key_length", KV_LORA + QK_ROPE)
    t.kv("attention.value_length", KV_LORA)
    t.kv("attention.key_length_mla", k_mla)
    t.kv("attention.value_length_mla", V_HEAD)
    t.kv("rope.dimension_count", QK_ROPE)
    t.moe_keys()
    t.kv("expert_shared_count", 1)
    if lite:
        t.kv("expert_weights_scale", 1.0)
    else:
        t.kv("expert_weights_scale", 2.5)
        t.kv("expert_weights_norm", True)
        t.kv("expert_gating_func", 2)  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        t.kv("expert_group_count", 4)
        t.kv("expert_group_used_count", 2)
        t.kv("rope.scaling.type", "yarn")
        t.kv("rope.scaling.factor", 4.0)
        t.kv("rope.scaling.original_context_length", 512)
        t.kv("rope.scaling.yarn_log_multiplier", 0.1)  # 0.1 * mscale_all_dim, as the converter writes it
    t.embeddings()
    for i in range(s.n_layer + nextn):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(n_embd))
        if lite:
            t.add(p + "attn_q.weight", t.weight(n_head * k_mla, n_embd))
        else:
            t.add(p + "attn_q_a_norm.weight", t.norm(Q_LORA))
            t.add(p + "attn_q_a.weight", t.weight(Q_LORA, n_embd))
            t.add(p + "attn_q_b.weight", t.weight(n_head * k_mla, Q_LORA))
        t.add(p + "attn_kv_a_norm.weight", t.norm(KV_LORA))
        t.add(p + "attn_kv_a_mqa.weight", t.weight(KV_LORA + QK_ROPE, n_embd))
        t.add(p + "attn_k_b.weight", t.weight(KV_LORA, QK_NOPE, n_head))  # ggml {qk_nope, kv_lora, n_head}
        t.add(p + "attn_v_b.weight", t.weight(V_HEAD, KV_LORA, n_head))  # ggml {kv_lora, v_head, n_head}
        t.add(p + "attn_output.weight", t.weight(n_embd, n_head * V_HEAD))
        t.add(p + "ffn_norm.weight", t.norm(n_embd))
        if i < dense_lead:
            t.ffn(p)
        else:
            _moe_with_shared(t, p, probs_bias=not lite)
        if i >= s.n_layer:
            _nextn(t, p)


@register("glm4moe", head_dim=32, rope_freq_base=1e6, token_embd_type="F32", tied=False)
def build_glm4moe(t: Tiny) -> None:
    """GLM-4.5-like: q/k norms, 2 leading dense blocks, one MTP block, untied."""
    _glm4moe(t, qk_norm=True, dense_lead=2, nextn=1)


@register("glm4moe-air", arch="glm4moe", head_dim=32, rope_freq_base=1e6, weight_type="Q8_0", seed=1)
def build_glm4moe_air(t: Tiny) -> None:
    """GLM-4.5-Air-like: no q/k norms, 1 leading dense block, one MTP block, tied, Q8_0 matrices."""
    _glm4moe(t, qk_norm=False, dense_lead=1, nextn=1)


def _glm4moe(t: Tiny, *, qk_norm: bool, dense_lead: int, nextn: int) -> None:
    """models/glm4-moe.cpp (GLM-4.5/4.6): q/k/v biases, ``post_attention_norm`` before the FFN,
    partial RoPE (``rope.dimension_count`` half the head), sigmoid gating with ``exp_probs_b``,
    a head width (32 x 4 heads = 128) other than ``n_embd`` (64), as GLM-4.5's 128 x 96 vs 5120.

    ``qk_norm``: GLM-4.5 (355B) has ``attn_q_norm``/``attn_k_norm``, GLM-4.5-Air not (both
    optional in the loader).
    """
    s = t.spec
    t.kv("block_count", s.n_layer + nextn)
    if nextn:
        t.kv("nextn_predict_layers", nextn)
    t.kv("attention.layer_norm_rms_epsilon", 1e-5)
    t.kv("attention.key_length", s.hd)
    t.kv("attention.value_length", s.hd)
    t.kv("rope.dimension_count", s.hd // 2)
    t.kv("leading_dense_block_count", dense_lead)
    t.moe_keys()
    t.kv("expert_shared_count", 1)
    t.kv("expert_weights_scale", 2.5)
    t.kv("expert_weights_norm", True)
    t.kv("expert_gating_func", 2)  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    t.embeddings()
    for i in range(s.n_layer + nextn):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p, bias=True)
        if qk_norm:
            t.add(p + "attn_q_norm.weight", t.norm(s.hd))
            t.add(p + "attn_k_norm.weight", t.norm(s.hd))
        t.add(p + "post_attention_norm.weight", t.norm(s.n_embd))
        if i < dense_lead:
            t.ffn(p)
        else:
            _moe_with_shared(t, p, probs_bias=True)
        if i >= s.n_layer:
            _nextn(t, p)
