"""Graphs with windows, chunks and sinks: cohere2, gpt-oss, llama4.

Each builder follows its loader at the pinned build (``src/models/<file>.cpp``,
``load_arch_hparams`` / ``load_arch_tensors``): the keys it requires, the
tensors it creates (names and shapes) and nothing it would not read (an
unread tensor fails the load: "wrong number of tensors").
"""

from __future__ import annotations

from tests.tiny.core import Tiny, register


@register("cohere2", token_embd_type="F32", extra_kv={"cohere2.attention.sliding_window": 8})
def build_cohere2(t: Tiny) -> None:
    """models/cohere2.cpp: layer norm without bias, a parallel attention + FFN block, RoPE only on the
    sliding-window layers (3 of every 4: ``load_swa_pattern(ml, 4)``), logits times ``logit_scale``,
    the lm_head always ``token_embd`` (``TENSOR_DUPLICATED``; an ``output.weight`` would be unread)."""
    s = t.spec
    t.kv("attention.layer_norm_epsilon", 1e-5)
    t.kv("logit_scale", 0.25)
    t.kv("rope.dimension_count", s.hd)
    t.kv("rope.freq_base_swa", 50000.0)  # read, but the graph ropes with the global base
    assert s.hd * s.n_head == s.n_embd  # wq is {n_embd, n_embd}
    t.add("token_embd.weight", t.rng.standard_normal((t.n_vocab, s.n_embd), dtype="float32"),
          s.token_embd_type)
    t.add("output_norm.weight", t.norm(s.n_embd))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p)
        t.ffn(p)


@register("gpt-oss", tied=False, head_dim=32, ctx_train=4096, rope_freq_base=150000.0,
          extra_kv={"gpt-oss.attention.sliding_window": 8})
def build_gpt_oss(t: Tiny) -> None:
    """models/openai-moe.cpp: windowed even layers (``load_swa_pattern(ml, 2)``), q/k/v biases, an
    output bias, per-head attention sinks, a post-attention norm, 8 experts with biases and a biased
    router (SWIGLU_OAI_MOE, SOFTMAX_WEIGHT gating), YaRN RoPE, ``output.weight`` required.
    Heads of 32 with 4 heads: q is 128 wide on a 64-wide residual, as gpt-oss's 64x64 on 2880."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-5)
    t.kv("attention.key_length", s.hd)
    t.kv("attention.value_length", s.hd)
    t.kv("rope.scaling.type", "yarn")
    t.kv("rope.scaling.factor", 32.0)
    t.kv("rope.scaling.original_context_length", 4096)
    t.moe_keys()
    t.embeddings()
    q_dim = s.n_head * s.hd
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.add(p + "post_attention_norm.weight", t.norm(s.n_embd))
        t.attention(p, bias=True)
        t.add(p + "attn_output.bias", t.bias(s.n_embd))
        t.add(p + "attn_sinks.weight", t.rng.standard_normal(s.n_head, dtype="float32"))
        t.experts(p)
        t.add(p + "ffn_gate_inp.bias", t.bias(s.n_expert))
        t.add(p + "ffn_gate_exps.bias", t.bias(s.n_ff_exp * s.n_expert).reshape(s.n_expert, s.n_ff_exp))
        t.add(p + "ffn_up_exps.bias", t.bias(s.n_ff_exp * s.n_expert).reshape(s.n_expert, s.n_ff_exp))
        t.add(p + "ffn_down_exps.bias", t.bias(s.n_embd * s.n_expert).reshape(s.n_expert, s.n_embd))
    assert q_dim != s.n_embd


@register("llama4", n_layer=16, tied=False, rope_freq_base=500000.0, n_ff=96,
          extra_kv={"llama4.interleave_moe_layer_step": 2})
def build_llama4(t: Tiny) -> None:
    """models/llama4.cpp: chunked attention on 3 of every 4 layers (``load_swa_pattern(ml, 4)``; the chunk
    is 8192 whatever the file says), RoPE + L2 q/k norm everywhere but every 4th layer (NoPE, with the
    attention temperature input instead), experts (sigmoid router, weights before the FFN) plus a
    shared expert on every ``interleave_moe_layer_step``-th layer, dense SwiGLU elsewhere, llama3
    ``rope_freqs``. 8 experts: ``use_kq_norm`` is on (off only for the 128-expert model type)."""
    s = t.spec
    t.kv("attention.layer_norm_rms_epsilon", 1e-5)
    t.kv("rope.dimension_count", s.hd)  # GGML_ASSERT(n_embd_head == n_rot)
    t.moe_keys()
    step = int(s.extra_kv.get("llama4.interleave_moe_layer_step", 1))
    t.kv("interleave_moe_layer_step", step)
    t.embeddings()
    # llama3-style frequency factors: one global tensor, shared by every layer (TENSOR_DUPLICATED)
    t.add("rope_freqs.weight", 1.0 + t.rng.uniform(0.0, 4.0, s.hd // 2).astype("float32"))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        t.add(p + "attn_norm.weight", t.norm(s.n_embd))
        t.attention(p)
        t.add(p + "ffn_norm.weight", t.norm(s.n_embd))
        if (i + 1) % step == 0:
            t.experts(p)
            t.ffn(p, s.n_ff_exp, suffix="_shexp")  # n_ff_shexp = n_ff_exp
        else:
            t.ffn(p)
