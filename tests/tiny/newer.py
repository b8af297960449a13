"""2026's families: gemma4, qwen3next (a hybrid of gated delta-net and attention layers).

Each builder follows ``load_arch_hparams`` / ``load_arch_tensors`` of
``src/models/<arch>.cpp`` at the pinned build (llama-cpp-python 0.3.36), and
the converter's choices where the loader leaves them open
(``conversion/gemma.py`` ``Gemma4Model``).
"""

from __future__ import annotations

import numpy as np

from tests.tiny.core import Tiny, register

#: gemma4: which layers are sliding-window (True) or global, by layer count; the boundary at 2
#: leaves the head without a global layer (refused), every other 2-hop split keeps both kinds
GEMMA4_PATTERNS = {
    8: [True, True, False, True, True, False, True, False],
    9: [True, True, False] * 3,
}
_GEMMA4 = {"n_layer": 8, "n_head": 4, "n_head_kv": 2, "head_dim": 16, "rope_freq_base": 1e6,
           "token_embd_type": "F32", "n_ff": 96, "n_ff_exp": 32}


def _gemma4(t: Tiny, *, moe: bool = False, per_layer: int = 0, shared_kv: int = 0, no_v: bool = False) -> None:
    """models/gemma4.cpp (and conversion/gemma.py ``Gemma4Model``).

    Keys: ``attention.sliding_window_pattern`` (per-layer array, required: ``ml.get_arr``),
    ``attention.sliding_window`` (required), ``embedding_length_per_layer_input`` (required; 0 =
    no per-layer embeddings), ``attention.key_length[_swa]``/``value_length[_swa]`` (a global
    layer's head is twice a local one's), ``rope.dimension_count[_swa]``, ``rope.freq_base_swa``,
    ``attention.head_count_kv`` per layer (globals have fewer KV heads), ``final_logit_softcapping``,
    ``attention.shared_kv_layers``. Tensors: ``rope_freqs`` (proportional RoPE of the global
    layers: factors 1 then 1e30 for the unrotated pairs, as the converter writes them); per
    layer q/k/v (``attn_v`` optional: "if v_proj is not present, use Kcur as Vcur"), q/k norms,
    post-attention/post-FFN norms, a GELU FFN, ``layer_output_scale`` {1}; MoE layers a router
    with ``ffn_gate_inp.scale``, pre/post norms, experts and the per-expert ``ffn_down_exps.scale``;
    per-layer embeddings ``per_layer_token_embd``/``per_layer_model_proj``/``per_layer_proj_norm``
    and per layer ``inp_gate``/``proj``/``post_norm``. Layers at or past ``n_layer - shared_kv``
    carry no K/V (``kv_flags = TENSOR_NOT_REQUIRED``).
    """
    s = t.spec
    pattern = GEMMA4_PATTERNS.get(s.n_layer) or [(i + 1) % 3 != 0 for i in range(s.n_layer)]
    hd_swa, hd_full = s.hd, 2 * s.hd
    n_kv = [s.n_head_kv if swa else 1 for swa in pattern]
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.kv("attention.sliding_window", 8)
    t.kv("attention.sliding_window_pattern", list(pattern))
    t.kv("attention.head_count_kv", n_kv)
    t.kv("attention.key_length", hd_full)
    t.kv("attention.value_length", hd_full)
    t.kv("attention.key_length_swa", hd_swa)
    t.kv("attention.value_length_swa", hd_swa)
    t.kv("rope.dimension_count", hd_full)
    t.kv("rope.dimension_count_swa", hd_swa)
    t.kv("rope.freq_base_swa", 10000.0)
    t.kv("embedding_length_per_layer_input", per_layer)
    t.kv("attention.shared_kv_layers", shared_kv)
    t.kv("final_logit_softcapping", 30.0)
    if moe:
        t.moe_keys()
    t.embeddings()
    n_rot = hd_full // 8  # partial_rotary_factor 0.25 of the global head, in pairs
    t.add("rope_freqs.weight", np.asarray([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32))
    if per_layer:
        t.add("per_layer_token_embd.weight",
              t.rng.standard_normal((t.n_vocab, per_layer * s.n_layer), dtype=np.float32), "F32")
        t.add("per_layer_model_proj.weight", t.weight(per_layer * s.n_layer, s.n_embd))
        t.add("per_layer_proj_norm.weight", t.norm(per_layer))
    kv_from = s.n_layer - shared_kv
    for i, swa in enumerate(pattern):
        p = f"blk.{i}."
        hd = hd_swa if swa else hd_full
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.add(p + "attn_q.weight", t.weight(hd * s.n_head, s.n_embd))
        t.add(p + "attn_q_norm.weight", t.norm(hd))
        if i < kv_from:
            t.add(p + "attn_k.weight", t.weight(hd * n_kv[i], s.n_embd))
            if not (no_v and not swa):
                t.add(p + "attn_v.weight", t.weight(hd * n_kv[i], s.n_embd))
            t.add(p + "attn_k_norm.weight", t.norm(hd))
        t.add(p + "attn_output.weight", t.weight(s.n_embd, hd * s.n_head))
        t.add(p + "post_attention_norm.weight", t.norm(s.n_embd))
        t.add(p + "layer_output_scale.weight", np.asarray([0.5 + 0.1 * i], dtype=np.float32))
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        t.ffn(p)
        t.add(p + "post_ffw_norm.weight", t.norm(s.n_embd))
        if moe:
            t.add(p + "ffn_gate_inp.scale", t.norm(s.n_embd))
            t.add(p + "pre_ffw_norm_2.weight", t.norm(s.n_embd))
            t.add(p + "post_ffw_norm_1.weight", t.norm(s.n_embd))
            t.add(p + "post_ffw_norm_2.weight", t.norm(s.n_embd))
            t.experts(p)
            t.add(p + "ffn_down_exps.scale", t.norm(s.n_expert))
        if per_layer:
            t.add(p + "inp_gate.weight", t.weight(per_layer, s.n_embd))
            t.add(p + "proj.weight", t.weight(s.n_embd, per_layer))
            t.add(p + "post_norm.weight", t.norm(s.n_embd))


@register("gemma4", **_GEMMA4)
def build_gemma4(t: Tiny) -> None:
    """Gemma 4 31B's shape: dense, global layers without ``attn_v`` (K doubles as V)."""
    _gemma4(t, no_v=True)


@register("gemma4-moe", arch="gemma4", **_GEMMA4)
def build_gemma4_moe(t: Tiny) -> None:
    """Gemma 4 26B-A4B's shape: every layer a dense FFN beside 8 experts (2 used)."""
    _gemma4(t, moe=True)


@register("gemma4-shared-kv", arch="gemma4", **{**_GEMMA4, "n_layer": 9})
def build_gemma4_shared_kv(t: Tiny) -> None:
    """KV sharing without per-layer embeddings: the last 3 of 9 layers reuse layers 4 (local) / 5 (global)."""
    _gemma4(t, shared_kv=3)


@register("gemma4-ple", arch="gemma4", **{**_GEMMA4, "n_layer": 9})
def build_gemma4_ple(t: Tiny) -> None:
    """Gemma 4 E2B/E4B's shape: per-layer token embeddings (16 wide) and 3 KV-shared layers."""
    _gemma4(t, per_layer=16, shared_kv=3)


# -- qwen3next ---------------------------------------------------------------------------

#: qwen3next's linear-attention sizes: head_k_dim = head_v_dim = ssm.state_size, k heads =
#: ssm.group_count, v heads = ssm.time_step_rank (more v heads than k heads, as in Qwen3-Next-80B)
QWEN3NEXT_SSM = {"d_state": 16, "n_group": 2, "dt_rank": 4, "d_conv": 4}
_QWEN3NEXT = {"n_layer": 9, "n_head": 4, "n_head_kv": 2, "head_dim": 16, "rope_freq_base": 1e7,
              "token_embd_type": "F32", "n_ff": 64, "n_ff_exp": 32, "tied": False}


def _qwen3next(t: Tiny, *, recurrent_layers: bool, mtp: bool) -> None:
    """models/qwen3next.cpp (and conversion/qwen.py ``Qwen3NextModel``).

    Keys: ``ssm.conv_kernel``/``inner_size``/``state_size``/``time_step_rank``/``group_count``
    (required), ``full_attention_interval`` (default 4: layer il is recurrent unless
    ``(il + 1) % interval == 0``) or the explicit per-layer ``attention.recurrent_layers``,
    ``expert_shared_feed_forward_length``, ``rope.dimension_count`` (a quarter of the head, the
    converter's ``partial_rotary_factor``), ``nextn_predict_layers`` (an MTP block after the trunk).
    Tensors: every layer ``attn_norm``, ``post_attention_norm``, a router, 8 experts, a shared
    expert with its 1-wide gate ``ffn_gate_inp_shexp``; attention layers a query+gate ``attn_q``
    (2 x head x n_head), k/v, q/k norms, ``attn_output``; gated delta-net layers the fused
    ``attn_qkv`` and ``attn_gate`` (z), ``ssm_conv1d``, ``ssm_dt.bias``, ``ssm_a`` (-exp(A_log),
    negative), ``ssm_ba``, ``ssm_norm`` and ``ssm_out``.
    """
    s, q = t.spec, QWEN3NEXT_SSM
    interval = 3
    n_all = s.n_layer + (1 if mtp else 0)
    recurrent = [i < s.n_layer and (i + 1) % interval != 0 for i in range(n_all)]
    key_dim = q["d_state"] * q["n_group"]
    value_dim = q["d_state"] * q["dt_rank"]
    t.kv("block_count", n_all)
    t.kv("attention.layer_norm_rms_epsilon", 1e-6)
    t.kv("attention.key_length", s.hd)
    t.kv("attention.value_length", s.hd)
    t.kv("rope.dimension_count", s.hd // 4)
    t.kv("ssm.conv_kernel", q["d_conv"])
    t.kv("ssm.state_size", q["d_state"])
    t.kv("ssm.group_count", q["n_group"])
    t.kv("ssm.time_step_rank", q["dt_rank"])
    t.kv("ssm.inner_size", value_dim)
    t.kv("full_attention_interval", interval)
    if recurrent_layers:
        t.kv("attention.recurrent_layers", recurrent)
    t.kv("expert_shared_feed_forward_length", s.n_ff)
    if mtp:
        t.kv("nextn_predict_layers", 1)
    t.moe_keys()
    t.embeddings()
    for i in range(n_all):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.add(p + "post_attention_norm.weight", t.norm(s.n_embd))
        if not recurrent[i]:
            t.add(p + "attn_q.weight", t.weight(2 * s.hd * s.n_head, s.n_embd))  # query and its gate
            t.add(p + "attn_k.weight", t.weight(s.hd * s.n_head_kv, s.n_embd))
            t.add(p + "attn_v.weight", t.weight(s.hd * s.n_head_kv, s.n_embd))
            t.add(p + "attn_output.weight", t.weight(s.n_embd, s.hd * s.n_head))
            t.add(p + "attn_q_norm.weight", t.norm(s.hd))
            t.add(p + "attn_k_norm.weight", t.norm(s.hd))
        else:
            t.add(p + "attn_qkv.weight", t.weight(2 * key_dim + value_dim, s.n_embd))
            t.add(p + "attn_gate.weight", t.weight(value_dim, s.n_embd))
            t.add(p + "ssm_conv1d.weight", t.weight(2 * key_dim + value_dim, q["d_conv"]))
            t.add(p + "ssm_dt.bias", t.bias(q["dt_rank"]))
            t.add(p + "ssm_a", -np.exp(t.bias(q["dt_rank"])))
            t.add(p + "ssm_ba.weight", t.weight(2 * q["dt_rank"], s.n_embd))
            t.add(p + "ssm_norm.weight", t.norm(q["d_state"]))
            t.add(p + "ssm_out.weight", t.weight(s.n_embd, value_dim))
        t.experts(p)
        t.add(p + "ffn_gate_inp_shexp.weight", t.weight(1, s.n_embd)[0])
        t.ffn(p, suffix="_shexp")
        if i >= s.n_layer:  # the MTP block (load_block_mtp)
            t.add(p + "nextn.eh_proj.weight", t.weight(s.n_embd, 2 * s.n_embd))
            t.add(p + "nextn.enorm.weight", t.norm(s.n_embd))
            t.add(p + "nextn.hnorm.weight", t.norm(s.n_embd))
            t.add(p + "nextn.shared_head_norm.weight", t.norm(s.n_embd))


@register("qwen3next", **_QWEN3NEXT)
def build_qwen3next(t: Tiny) -> None:
    """Qwen3-Next-80B-A3B's shape as the converter writes it now: explicit recurrent_layers, an MTP block."""
    _qwen3next(t, recurrent_layers=True, mtp=True)


@register("qwen3next-interval", arch="qwen3next", **_QWEN3NEXT)
def build_qwen3next_interval(t: Tiny) -> None:
    """An older conversion: only ``full_attention_interval`` says which layers attend (of the absolute index)."""
    _qwen3next(t, recurrent_layers=False, mtp=False)
