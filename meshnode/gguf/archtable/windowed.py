"""Graphs with windows, chunks and sinks: cohere2, gpt-oss, llama4.

All three build their attention input with ``build_attn_inp_kv_iswa`` and
set a window type in ``load_arch_hparams`` whatever the file says (llama4
unless it declares ``sliding_window = 0``), so a slice must hold at least one
windowed layer (``create_memory``: ``GGML_ASSERT(hparams.is_swa_any())``,
llama-model.cpp): arch.py refuses a range without one and any boundary whose
head or tail side has none (``_windowless_side``). Their window flags come
from ``load_swa_pattern`` and reach every slice as an explicit per-layer
``{arch}.attention.sliding_window_pattern`` (``slice_kv``).
"""

from __future__ import annotations

from math import gcd

from meshnode.gguf.arch import ArchPolicy, Meta, Output, Refused, Swa, meta_int

#: llama-hparams.h ``n_no_rope_layer_step = 4``; llama4.cpp's chunked branch keeps it
_LLAMA4_NOPE_STEP = 4


def _llama4_boundaries(meta: Meta, arch: str, n_layer: int) -> dict[int, str]:
    """Where llama4 (models/llama4.cpp) can be cut.

    * ``load_arch_hparams``: a file declaring ``sliding_window = 0`` gets
      ``swa_type = LLAMA_SWA_TYPE_NONE`` and ``n_no_rope_layer_step = n_layer()``,
      so ``use_rope = (il + 1) % n_no_rope_layer_step != 0`` skips RoPE on the
      last layer of whatever is loaded (a slice would skip it on its own last
      layer); that layer then multiplies Q by ``inp_attn_scale``, whose
      ``set_input`` asserts ``f_attn_temp_scale != 0`` (llama-graph.cpp), a value
      only the chunked branch sets: such a file aborts even whole at this build.
      No cut.
    * Otherwise RoPE (and the L2 q/k norm, ``use_rope && use_kq_norm``) is
      skipped on every 4th layer, ``(il + 1) % 4 == 0``, and experts sit on
      every ``interleave_moe_layer_step``-th, ``(i + 1) % n_moe_layer_step == 0``
      in ``load_arch_tensors`` (the loader then looks for ``ffn_gate_inp`` /
      ``*_exps`` / ``*_shexp`` or ``ffn_gate/up/down`` by that rule): both
      of the absolute index, with no key a slice could restate them by. A cut
      must keep both phases: multiples of lcm(4, step).
    * A range with no RoPE-less layer never uses ``inp_attn_scale`` (built
      unconditionally by ``build_inp_attn_scale``), so the graph allocator
      gives it no buffer and its ``set_input`` aborts: ``ggml_backend_tensor_set``,
      ``GGML_ASSERT(buf != NULL && "tensor buffer not set")``. Between
      multiples of 4 every range holds one (layer 4j+3) except a tail
      shorter than 4 layers, refused here.
    """
    w = meta.get(f"{arch}.attention.sliding_window")
    if isinstance(w, int) and not isinstance(w, bool) and w == 0:
        why = ("llama4 without chunked attention (sliding_window = 0) skips RoPE on the last layer of whatever "
               "it loads (n_no_rope_layer_step = n_layer()), so a slice would skip it on its own last layer "
               "(and llama.cpp aborts such a file even whole: GGML_ASSERT(f_attn_temp_scale != 0.0f))")
        return dict.fromkeys(range(1, n_layer), why)
    moe_step = meta_int(meta, f"{arch}.interleave_moe_layer_step")
    step = _lcm(_LLAMA4_NOPE_STEP, max(moe_step, 1))
    phase = (f"llama4 skips RoPE on the layers il with (il + 1) % {_LLAMA4_NOPE_STEP} == 0"
             + (f" and puts experts on those with (il + 1) % {moe_step} == 0" if moe_step > 1 else "")
             + f", of the absolute index with no key to restate it: cuts must fall on multiples of {step}")
    out = {k: phase for k in range(1, n_layer) if k % step}
    for k in range(1, n_layer):
        if k not in out and not any((il + 1) % _LLAMA4_NOPE_STEP == 0 for il in range(k, n_layer)):
            out[k] = (f"layers {k}:{n_layer} of llama4 hold no layer without RoPE, so the graph never uses its "
                      "attention-temperature input and llama.cpp aborts setting it (tensor buffer not set)")
    return out


def _lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


ENTRIES: list[ArchPolicy] = [
    ArchPolicy(
        "cohere2", "models/cohere2.cpp", swa=Swa(period=4, always=True), output=Output.TIED,
        families="Command R7B, Command A, Aya Vision (text)",
        note="load_arch_hparams: swa_type = LLAMA_SWA_TYPE_STANDARD, load_swa_pattern(ml, 4), sliding_window "
             "required: 3 windowed layers of every 4, carried as explicit flags, which also decide RoPE "
             "(graph: `if (is_swa)` ropes Q/K, global layers have none); parallel block (attention and FFN "
             "both read attn_norm's output, l_out = ffn + inpL + attn); logit_scale and layer norm are global "
             "keys; lm_head always token_embd (TENSOR_DUPLICATED, output.weight never read); a head or tail "
             "of only global layers (e.g. the last layer of a 32-layer model) cannot load: "
             "GGML_ASSERT(is_swa_any()) in create_memory",
        test="tests/test_arch_windowed.py"),
    ArchPolicy(
        "gpt-oss", "models/openai-moe.cpp", swa=Swa(period=2, always=True), output=Output.REQUIRED, moe=True,
        families="gpt-oss-20b, gpt-oss-120b",
        note="load_arch_hparams: swa_type = LLAMA_SWA_TYPE_STANDARD, load_swa_pattern(ml, 2) (even layers "
             "windowed, carried as explicit flags; they also pick rope_freq_base_train_swa via "
             "get_rope_freq_base); attn_sinks, q/k/v/o biases, router and expert biases are per-layer tensors; "
             "output.weight required (flags 0): non-tail slices carry a 1-row stand-in; the last layer's "
             "get_rows happens inside it only when cparams.embeddings_nextn_masked (false unless "
             "llama_set_embeddings_nextn, llama-context.cpp), else after the loop on t_h_nextn, and a "
             "capturing hop outputs every row anyway, so l_out-{n-1} is the full residual; the odd last "
             "layer of a 24/36-layer model is global, so no route ends a hop before it (is_swa_any)",
        test="tests/test_arch_windowed.py"),
    ArchPolicy(
        "llama4", "models/llama4.cpp", swa=Swa(period=4, always=True), moe=True,
        boundary_rule=_llama4_boundaries,
        families="Llama 4 Scout (17B-16E), Llama 4 Maverick (17B-128E)",
        note="load_arch_hparams: without sliding_window = 0, swa_type = LLAMA_SWA_TYPE_CHUNKED with n_swa forced "
             "to 8192 and load_swa_pattern(ml, 4) (3 chunked, 1 full; explicit flags in slices, they also pick "
             "rope_freq_base_train_swa); use_rope = (il + 1) % n_no_rope_layer_step (4, llama-hparams.h) and "
             "MoE layers (i + 1) % interleave_moe_layer_step are of the absolute index: cuts at multiples of "
             "lcm(4, step) only; a range without a RoPE-less layer leaves inp_attn_scale unallocated and "
             "aborts in llm_graph_input_attn_temp::set_input (\"tensor buffer not set\"), refused; "
             "sliding_window = 0 files are refused everywhere (RoPE skipped on the loaded model's last "
             "layer; llama.cpp also asserts f_attn_temp_scale != 0 on them); use_kq_norm from the model type "
             "(expert count), attention temperature from positions: neither depends on the range",
        test="tests/test_arch_windowed.py"),
]

REFUSED: list[Refused] = []
