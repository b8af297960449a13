"""Leading dense blocks, MLA and next-token-prediction blocks: deepseek2, glm4moe.

What both share, generic in arch.py/slicer.py: ``leading_dense_block_count``
(``dense_lead``: dense FFN below it, MoE above, a test of the absolute index
``il < n_layer_dense_lead`` in the graph and in ``load_arch_tensors``), and
the next-token-prediction (MTP) blocks after the trunk, dropped from every
slice (``n_layer() = n_layer_all - n_layer_nextn``, llama-hparams.cpp; the
trunk graph loops ``il < n_layer`` and the MTP graph is another graph type,
``LLM_GRAPH_TYPE_DECODER_MTP``, which a route never builds).

What is particular, in the rule functions here:

* deepseek2 decides ``is_lite`` from the layer count (and vocabulary size), and
  a lite model never reads ``q_lora_rank`` (``_deepseek2_lite``,
  ``_deepseek2_range``, ``_deepseek2_kv``); it also picks the expert gating
  function from the layer count when the file has none.
* glm4moe's graph refuses any embeddings input unless M-RoPE is in use
  (``_glm4moe_kv``).
"""

from __future__ import annotations

from typing import Any

from meshnode.gguf.arch import ArchPolicy, Meta, Refused

# -- deepseek2 -------------------------------------------------------------------------------

#: models/deepseek2.cpp load_arch_hparams: ``is_lite = (n_layer() == 27 || n_layer() == 26 ||
#: (n_layer() == 48 && n_vocab == 128256))``
_LITE_LAYERS = (26, 27)
_LITE_48_VOCAB = 128256
#: load_arch_hparams, gating default: ``(n_layer() == 47 || n_layer() == 48) && n_vocab == 154880``
#: (GLM 4.7 Lite) -> SIGMOID, else SOFTMAX (llama-hparams.h: SOFTMAX = 1, SIGMOID = 2)
_GLM_LITE_LAYERS = (47, 48)
_GLM_LITE_VOCAB = 154880
_SOFTMAX, _SIGMOID = 1, 2


def _n_vocab(meta: Meta) -> int:
    """n_vocab as deepseek2.cpp reads it: ``{arch}.vocab_size``, else the length of the token list."""
    arch = meta.get("general.architecture")
    v = meta.get(f"{arch}.vocab_size")
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    toks = meta.get("tokenizer.ggml.tokens")
    try:
        return len(toks) if toks is not None else 0  # a list, or meta.ArrayInfo when not decoded
    except TypeError:
        return 0


def _is_lite(n_layer: int, n_vocab: int) -> bool:
    return n_layer in _LITE_LAYERS or (n_layer == 48 and n_vocab == _LITE_48_VOCAB)


def _deepseek2_lite(meta: Meta, arch: str, n_layer: int) -> bool:
    """Whether llama.cpp takes the whole model for 'lite' (from ``n_layer()``, the trunk)."""
    return _is_lite(n_layer, _n_vocab(meta))


def _slice_vocab(meta: Meta, n_layer: int, end: int) -> int:
    """n_vocab of a slice: a non-tail slice carries a one-token stand-in vocabulary (slicer.py)."""
    return _n_vocab(meta) if end == n_layer else 1


def _q_lora_rank(meta: Meta, arch: str) -> int:
    v = meta.get(f"{arch}.attention.q_lora_rank", 0)
    return int(v) if isinstance(v, int) else 0


def _deepseek2_range(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> str | None:
    """A slice llama.cpp takes for lite when the whole model is not (with a ``q_lora_rank``).

    deepseek2.cpp ``load_arch_hparams`` reads ``q_lora_rank`` only ``if (!is_lite)``;
    ``load_arch_tensors`` then loads ``attn_q`` when ``n_lora_q == 0`` and
    ``attn_q_a``/``attn_q_a_norm``/``attn_q_b`` otherwise. A lite-sized slice (26 or 27
    layers; 48 for a tail with a 128256-token vocabulary) of a model with ``q_lora_rank > 0``
    would look for ``attn_q``, which the model does not have (and its low-rank query, a
    norm between two matrices, has no single-matrix equivalent): refused. The converse (a
    slice of a lite model) is stated by ``_deepseek2_kv``.
    """
    if _deepseek2_lite(meta, arch, n_layer) or _q_lora_rank(meta, arch) == 0:
        return None
    n = end - start
    if _is_lite(n, _slice_vocab(meta, n_layer, end)):
        return (f"llama.cpp takes a {n}-layer deepseek2 model for 'lite' (is_lite from the layer count in "
                "deepseek2.cpp load_arch_hparams), which ignores q_lora_rank and loads attn_q instead of "
                "this model's attn_q_a/attn_q_b")
    return None


def _deepseek2_kv(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> dict[str, Any]:
    """What deepseek2.cpp ``load_arch_hparams`` derives from the whole model's layer count,
    stated in every slice (whose own layer count would derive it otherwise).

    * A lite whole model has ``n_lora_q = 0`` whatever its file says; a slice that is not
      lite-sized reads ``q_lora_rank`` (required): it gets 0, so it loads ``attn_q`` too.
    * With no ``expert_gating_func`` (or 0, NONE), the gating is SIGMOID for 47/48 layers and
      a 154880-token vocabulary, else SOFTMAX: the slice states the whole model's choice.
    """
    put: dict[str, Any] = {}
    if _deepseek2_lite(meta, arch, n_layer):
        put[f"{arch}.attention.q_lora_rank"] = 0
    if not meta.get(f"{arch}.expert_gating_func"):
        glm_lite = n_layer in _GLM_LITE_LAYERS and _n_vocab(meta) == _GLM_LITE_VOCAB
        put[f"{arch}.expert_gating_func"] = _SIGMOID if glm_lite else _SOFTMAX
    return put


# -- glm4moe ---------------------------------------------------------------------------------

#: a stand-in M-RoPE section split: with the three position rows equal (below) every section
#: rotates by the same angle, so any split with sections[0] > 0, sections[1] > 0 and no fourth
#: section computes NEOX RoPE bit for bit
_MROPE_STANDIN = [1, 1, 0, 0]


def _glm4moe_kv(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> dict[str, Any]:
    """glm4-moe.cpp graph: ``if (ubatch.embd && !use_mrope) GGML_ABORT("This GGUF does not support
    multimodal...")``, and every hop of a route is fed embeddings (the head looks its token rows
    up itself). A slice therefore always declares ``rope.dimension_sections`` (the source's, if it
    already uses M-RoPE; else a stand-in), which makes ``use_mrope()`` true
    (llama-hparams.cpp: ``rope_sections[0] > 0 && rope_sections[1] > 0``) and the rope type
    ``LLAMA_ROPE_TYPE_MROPE`` instead of NEOX (llama-model.cpp ``llama_model_rope_type``).

    That is exact: for MROPE, ggml-cpu ops.cpp ``ggml_mrope_cache_init`` keeps one running
    angle per section, each started at its position row and multiplied by ``theta_scale`` per
    pair exactly as ``ggml_rope_cache_init`` does, and rotates pairs as NEOX does
    (``rotate_pairs(n_dims, n_dims/2, ...)`` for both); with the position rows (t, h, w) all
    equal to the token's position and the fourth section empty (its row, 0, is never read),
    every angle is NEOX's. The executor gives an embeddings batch those rows (executor/
    _llama.py: ``[p, p, p, 0]`` section-major, what llama-graph.cpp ``llm_graph_input_pos::
    set_input`` makes of a token batch's positions).
    """
    key = f"{arch}.rope.dimension_sections"
    src = meta.get(key)
    if isinstance(src, list) and len(src) == 4 and int(src[0]) > 0 and int(src[1]) > 0:
        return {key: [int(x) for x in src]}  # stated anyway, so a 4-layer slice never cuts it as per-layer
    return {key: list(_MROPE_STANDIN)}


ENTRIES: list[ArchPolicy] = [
    ArchPolicy(
        "deepseek2", "models/deepseek2.cpp", dense_lead=True, moe=True,
        range_rule=_deepseek2_range, resolved_kv=_deepseek2_kv,
        families="DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-V2.5, DeepSeek-V3, DeepSeek-R1, Kimi K2, "
                 "GLM-4.7-Flash, GigaChat3, Kanana-2",
        note=("graph::graph: MLA (wq_a/attn_q_a_norm/wq_b or wq, wkv_a_mqa, split wk_b/wv_b), no input "
              "scale, l_out-{il}; every layer's attention is the same; ffn dense iff "
              "il < n_layer_dense_lead (dense_lead), else MoE + shared expert with ffn_exp_probs_b, "
              "expert_weights_norm/scale and gating from keys; YaRN kq_scale from rope_yarn_log_mul and "
              "freq_scale (keys, not layer count); the optional attention temperature is of the position "
              "(llm_graph_input_attn_temp), not the layer. load_arch_hparams: is_lite from n_layer() (26/27, or 48 "
              "with n_vocab 128256) skips q_lora_rank: a lite-sized slice of a q_lora_rank model is refused "
              "(_deepseek2_range), a slice of a lite model states q_lora_rank = 0; a missing "
              "expert_gating_func is resolved from the whole model's n_layer()/n_vocab (_deepseek2_kv). "
              "MTP blocks (i >= n_layer, nextn.*) dropped; llm_type from n_layer() is only a label"),
        test="tests/test_arch_deepseek.py"),
    ArchPolicy(
        "glm4moe", "models/glm4-moe.cpp", dense_lead=True, moe=True, resolved_kv=_glm4moe_kv,
        families="GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7, GLM-4.5V/4.6V (text), Solar Open",
        note=("graph::graph: no input scale; q/k/v biases, optional attn_q_norm/attn_k_norm, partial "
              "RoPE (n_rot), post_attention_norm, dense FFN iff il < n_layer_dense_lead (dense_lead), else "
              "sigmoid-gated MoE with exp_probs_b + shared expert; l_out-{il}. The graph aborts on "
              "embeddings input unless use_mrope(): slices declare rope.dimension_sections with equal "
              "position rows, which is NEOX RoPE bit for bit (_glm4moe_kv). MTP blocks (nextn.*) dropped; "
              "llm_type from n_layer() is only a label"),
        test="tests/test_arch_deepseek.py"),
]

REFUSED: list[Refused] = []
