"""Dense llama-like graphs: llama (Mixtral's experts too), qwen2, qwen3, gemma3."""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, InputScale, Refused, Swa

# -- the table -------------------------------------------------------------------------

_LLAMA_NOTE = ("embeddings enter layer 0 unchanged; every per-layer behaviour comes from per-layer tensors; "
               "experts (Mixtral) are per-layer tensors too")

ENTRIES = [
    ArchPolicy("llama", "models/llama.cpp", families="Llama 2/3/3.1/3.2/3.3, Mistral 7B, Mixtral 8x7B/8x22B, "
               "SmolLM2, TinyLlama", note=_LLAMA_NOTE,
               test="tests/test_arch_parity.py, tests/test_arch_moe.py (Mixtral's experts, Llama 3.1's rope_freqs)"),
    ArchPolicy("qwen2", "models/qwen2.cpp", families="Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen",
               note="q/k/v biases are per-layer tensors", test="tests/test_arch_parity.py"),
    ArchPolicy("qwen3", "models/qwen3.cpp", families="Qwen3 0.6B-32B", note="q/k norms are per-layer tensors",
               test="tests/test_arch_parity.py"),
    ArchPolicy(
        "gemma3", "models/gemma3.cpp", input_scale=InputScale.TOKENS_SQRT_EMBD,
        swa=Swa(period=6), layer_count_dependent=frozenset({62}),
        families="Gemma 3 270M-27B",
        note="token input x sqrtf(n_embd), embeddings input not: the head scales its own lookup; local layers "
             "5 of every 6 (or the file's pattern) carried as explicit flags; 27B (62 layers) takes its "
             "attention scale from the layer count",
        test="tests/test_arch_parity.py"),
]

REFUSED: list[Refused] = []
