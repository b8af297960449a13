"""Graphs that scale their input: granite, granitemoe (embedding_scale), gemma2 (sqrt(n_embd)); phi3.

Read at the pinned build (``vendor/llama.cpp/src``):

* granite / granitemoe: ``llama-graph.cpp`` ``build_inp_embd`` multiplies the input by
  ``f_embedding_scale`` when ``f_embedding_scale != 0.0f && (ubatch.token || n_deepstack_layers == 0)``:
  embeddings input too. The head feeds its own token rows as embeddings and keeps the file's scale (the
  same ``ggml_scale`` on the same rows as the whole model's token path); middle and tail slices say
  ``embedding_scale = 0``, which that test reads as "no scale" (``InputScale.EMBEDDING_SCALE_KEY``).
  ``models/granite.cpp``: ``f_residual_scale`` (``build_layer_ffn``), ``f_attention_scale``
  (``build_attention_layer``: ``kq_scale``) and ``f_logit_scale`` (after the lm_head) are
  model-wide keys a slice keeps; ``rope.scaling.finetuned`` fills ``rope_pattern`` for every layer
  alike (``std::fill``); ``type`` from ``n_layer()`` (32/40/64) is only a label. granite-moe.cpp
  reuses ``llama_model_granite::graph`` (models.h: ``using graph = llama_model_granite::graph``).
* gemma2: ``models/gemma2.cpp`` ``inpL = ggml_scale(ctx0, inpL, sqrtf(n_embd)); cb(inpL, "inp_scaled", -1)``
  for any input: middle and tail hops overwrite ``inp_scaled`` with their input (native/capture.c).
* phi3: ``models/phi3.cpp`` sets ``swa_type = LLAMA_SWA_TYPE_NONE`` for a declared window.
"""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, InputScale, Meta, Output, Refused, Swa


def granite_deepstack(meta: Meta, arch: str, n_layer: int) -> dict[int, str]:
    """Granite 4 Vision's ``deepstack_mapping`` (granite.cpp ``load_arch_hparams``): a mapped layer adds a
    column block of the input (``res->t_inp_embd`` viewed at ``deepstack_emb_idx * n_embd``), the input
    is ``n_embd * (1 + n_deepstack_layers)`` wide (llama-hparams.cpp ``n_embd_inp``) and an embeddings
    input is no longer scaled (``build_inp_embd``: ``n_deepstack_layers == 0``): a hop's residual input
    carries neither that stream nor the head's scale, so no cut is exact."""
    mapping = meta.get(f"{arch}.deepstack_mapping")
    if isinstance(mapping, list) and any(int(x) >= 0 for x in mapping):
        reason = ("it declares a deepstack_mapping (Granite Vision): mapped layers add a stream of the "
                  "widened input that a hop's residual does not carry, and llama.cpp leaves an embeddings "
                  "input unscaled then")
        return dict.fromkeys(range(1, n_layer), reason)
    return {}


_GRANITE_NOTE = (
    "llama-graph.cpp build_inp_embd scales embeddings input too (f_embedding_scale != 0 && (ubatch.token || "
    "n_deepstack_layers == 0)): middle/tail slices set embedding_scale = 0 ('no scale'), the head keeps it; "
    "granite.cpp residual_scale, attention.scale (kq_scale), logit_scale and rope.scaling.finetuned "
    "(rope_pattern filled alike for every layer) are model-wide; the type switch on n_layer() is a label. "
    "rope_freqs is one global tensor every slice carries. Under rope.scaling.type longrope the loader takes "
    "rope_factors_long/short instead, chosen per context (llama-model.cpp get_rope_factors: n_ctx_seq > "
    "n_ctx_orig_yarn), as phi3: hops on different sides of it are refused as a route (numerics_key)"
)

ENTRIES = [
    ArchPolicy(
        "granite", "models/granite.cpp, llama-graph.cpp", input_scale=InputScale.EMBEDDING_SCALE_KEY,
        boundary_rule=granite_deepstack,
        families="IBM Granite 3.0/3.1/3.2/3.3 2B and 8B (dense)",
        note=_GRANITE_NOTE + "; a deepstack_mapping (Granite 4 Vision) is refused at every boundary",
        test="tests/test_arch_scaled.py"),
    ArchPolicy(
        "granitemoe", "models/granite-moe.cpp, models/granite.cpp, llama-graph.cpp",
        input_scale=InputScale.EMBEDDING_SCALE_KEY, moe=True,
        families="IBM Granite 3.0/3.1 1B-A400M and 3B-A800M, Granite MoE Shared",
        note=_GRANITE_NOTE + "; experts are feed_forward_length wide and the optional shared expert "
             "(expert_shared_feed_forward_length) is per-layer tensors; granite-moe.cpp reads no "
             "deepstack mapping",
        test="tests/test_arch_scaled.py"),
    ArchPolicy(
        "gemma2", "models/gemma2.cpp", input_scale=InputScale.ALL_SQRT_EMBD,
        swa=Swa(period=2, always=True), output=Output.TIED, layer_count_dependent=frozenset({46}),
        families="Gemma 2 2B, 9B (27B whole only)",
        note="gemma2.cpp scales any input by sqrtf(n_embd) into 'inp_scaled': middle/tail hops overwrite it "
             "with their input (native/capture.c restore); swa_type STANDARD always (n_swa 4096 unless the "
             "file says), load_swa_pattern(ml, 2) carried as explicit per-layer flags, so a range of only "
             "global layers is refused (create_memory asserts is_swa_any()), e.g. the last layer alone; "
             "rope.freq_base_swa per layer via is_swa; attn/final logit softcapping and post norms are "
             "model-wide or per-layer tensors; lm_head always token_embd (TENSOR_DUPLICATED); 27B "
             "(n_layer() == 46) takes f_attention_scale = 1/sqrt(n_embd/n_head) instead of "
             "1/sqrt(n_embd_head_k), so neither it nor a 46-layer slice is cut",
        test="tests/test_arch_scaled.py"),
    ArchPolicy(
        "phi3", "models/phi3.cpp", swa_ignored=True,
        families="Phi-3 mini/medium (4k and 128k), Phi-3.5 mini, Phi-4, Phi-4 mini",
        note="phi3.cpp load_arch_hparams: a declared sliding window sets swa_type = LLAMA_SWA_TYPE_NONE, "
             "n_swa = 0, set_swa_pattern(1) (no layer windowed); fused attn_qkv and gate+up (ffn_up, "
             "LLM_FFN_SWIGLU) are per-layer tensors; rope_factors_long/short are one global pair every "
             "slice carries, picked by llama-model.cpp get_rope_factors from the context (n_ctx_seq > "
             "n_ctx_orig_yarn): every hop advertises that original context with its numerics (rope_ctx_orig) "
             "and a route whose hops lie on different sides of it is refused (wire/codec.py numerics_key); "
             "the type switch on n_layer() is a label",
        test="tests/test_arch_scaled.py"),
]

REFUSED: list[Refused] = []
