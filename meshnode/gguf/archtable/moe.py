"""Mixture-of-experts and other llama-like graphs: qwen3moe, qwen2moe, mistral3, command-r, olmo2.

Mixtral (arch ``llama`` with ``llama.expert_count``) and Llama 3.1's
``rope_freqs.weight`` are the ``llama`` entry (dense.py); tests/test_arch_moe.py
shows both cut exactly: models/llama.cpp takes the MoE branch per layer
(``if (model.layers[il].ffn_gate_inp == nullptr)``), and ``rope_freqs`` is a
tensor outside ``blk.N`` (created for layer 0, ``TENSOR_DUPLICATED`` for the
others, returned by ``llama_model::get_rope_factors``), so every slice carries it.
"""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, Meta, Output, Refused, Swa

#: models/command-r.cpp load_arch_tensors: ``if (n_layer >= 64)`` creates attn_q_norm / attn_k_norm
COMMAND_R_QK_NORM_LAYERS = 64


def _command_r_qk_norm(n_layer: int) -> str:
    return (f"command-r creates its q/k norms only when the file it loads has >= {COMMAND_R_QK_NORM_LAYERS} "
            f"layers (models/command-r.cpp: if (n_layer >= {COMMAND_R_QK_NORM_LAYERS})): this {n_layer}-layer "
            f"model has them, and a slice of fewer layers would neither load nor apply them")


def _command_r_boundaries(meta: Meta, arch: str, n_layer: int) -> dict[int, str]:
    """A range ending at k has at most k layers, one starting at k at most n_layer - k: with q/k norms
    (n_layer >= 64) both must reach 64."""
    if n_layer < COMMAND_R_QK_NORM_LAYERS:
        return {}
    q = COMMAND_R_QK_NORM_LAYERS
    return {k: _command_r_qk_norm(n_layer) for k in range(1, n_layer) if k < q or n_layer - k < q}


def _command_r_range(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> str | None:
    if n_layer >= COMMAND_R_QK_NORM_LAYERS > end - start:
        return _command_r_qk_norm(n_layer)
    return None


ENTRIES = [
    ArchPolicy("qwen3moe", "models/qwen3moe.cpp", moe=True, families="Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder",
               note="router, experts and q/k norms are per-layer tensors; expert_feed_forward_length is read with "
                    "get_key_or_arr and a slice carries its layers' entries (every layer's tensors are created with "
                    "n_ff_exp(), layer 0's width)",
               test="tests/test_arch_moe.py"),
    ArchPolicy(
        "qwen2moe", "models/qwen2moe.cpp", output=Output.REQUIRED, moe=True,
        families="Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
        note="router, experts, shared expert and its sigmoid gate (ffn_gate_inp_shexp) are per-layer tensors; "
             "expert widths from expert_feed_forward_length / expert_shared_feed_forward_length (copied); "
             "output.weight is created with flags 0, so non-tail slices carry a 1-row stand-in "
             "(its lm_head is never computed there)",
        test="tests/test_arch_moe.py"),
    ArchPolicy(
        "mistral3", "models/mistral3.cpp",
        families="Ministral 3 3B/8B/14B, Mistral Small 3.1/3.2 (text, newer conversions)",
        note="load_arch_hparams reads attention.temperature_scale and the yarn keys, none per layer; the "
             "temperature (build_inp_attn_scale, llm_graph_input_attn_temp::set_input) is "
             "log(floor(pos / n_ctx_orig_yarn) + 1) * scale + 1 of the position only, which every hop is "
             "given; n_layer only picks the model type name; rope_freqs and experts as in llama",
        test="tests/test_arch_moe.py"),
    ArchPolicy(
        "command-r", "models/command-r.cpp", output=Output.TIED,
        boundary_rule=_command_r_boundaries, range_rule=_command_r_range,
        families="Command R 35B, Command R+ 104B, Aya 23",
        note="one LayerNorm feeds attention and FFN in parallel, both added to the layer input; the lm_head is "
             "always token_embd (TENSOR_DUPLICATED), scaled by logit_scale in the tail; q/k norms exist only "
             f"when n_layer >= {COMMAND_R_QK_NORM_LAYERS} (load_arch_tensors), so a model that has them is cut "
             f"only into ranges of >= {COMMAND_R_QK_NORM_LAYERS} layers (Command R+'s 64: not at all)",
        test="tests/test_arch_moe.py"),
    ArchPolicy(
        "olmo2", "models/olmo2.cpp", output=Output.REQUIRED, swa=Swa(period=4),
        families="OLMo 2 1B/7B/13B/32B, Olmo 3 7B/32B",
        note="post-norms and q/k norms are per-layer tensors; output.weight is created with flags 0 (1-row "
             "stand-in in non-tail slices); a window (sliding_window > 0, Olmo 3) comes through "
             "load_swa_pattern(ml, 4), carried as explicit flags; is_swa(il) also picks the rope "
             "(windowed layers: freq_scale 1, no yarn), so the flags carry that too; rope.freq_base_swa is "
             "read but the graph uses freq_base",
        test="tests/test_arch_moe.py"),
]

REFUSED: list[Refused] = []
