"""Tiny random-weight GGUF models of the architectures meshnode cuts.

No model hub is reachable from the tests, so a model of each supported graph
is synthesized here: a few small layers with random weights, and the real
tokenizer of the default model (SmolLM2, a gpt2-style BPE of 49152 tokens)
copied key for key, so that tokenization, the vocabulary-sized token table and
the logits are those of a real vocabulary. Every tensor name, shape and
required key follows llama.cpp's loaders at the pinned build
(``src/models/{llama,qwen2,qwen3,gemma3}.cpp``, ``load_arch_hparams`` /
``load_arch_tensors``; names from ``src/llama-arch.cpp``).

Weights are N(0, 1/fan_in) for matrices, N(0, 1) for token embeddings,
1 + N(0, 0.1^2) for norms and N(0, 0.1^2) for biases, so activations stay
O(1) and the logits of different tokens differ clearly (greedy decoding is
not a tie-break between equal logits).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshnode.gguf.slicer import add_inferred as _add_inferred

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_QTYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    # repacked for llama.cpp's CPU_REPACK matmul on AVX2 (a 2D matrix of a multiple of 8 rows)
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
}
#: general.file_type (llama_ftype) of a file whose matrices are of this type
_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}


Field = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


@functools.cache
def tokenizer_fields(source: Path) -> tuple[Field, ...]:
    """Every ``tokenizer.*`` key of ``source`` as (key, value, type, element type).

    Memoised: parsing a 49152-token vocabulary with the gguf package takes ~2 s.
    """
    reader = gguf.GGUFReader(source, "r")
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in out):
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return tuple(out)


def truncated_vocab(fields: Sequence[Field], n_vocab: int) -> tuple[Field, ...]:
    """The first ``n_vocab`` tokens of a gpt2-style BPE vocabulary, still a valid one.

    The token list and types are cut; a merge survives if both its pieces and
    its result are kept tokens. The byte-level base tokens come first in the
    vocabularies this is used on (SmolLM2: ids 17..251), so every byte still
    has its token and llama.cpp's BPE never meets a piece it cannot encode.
    Special-token ids beyond ``n_vocab`` are dropped.
    """
    by_key = {f[0]: f for f in fields}
    if by_key["tokenizer.ggml.model"][1] != "gpt2":
        raise ValueError("only gpt2-style BPE vocabularies can be truncated")
    tokens = list(by_key["tokenizer.ggml.tokens"][1])[:n_vocab]
    kept = set(tokens)
    out: list[Field] = []
    for key, value, vtype, sub in fields:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = list(value)[:n_vocab]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if (ab := m.split(" ", 1)) and len(ab) == 2
                     and ab[0] in kept and ab[1] in kept and ab[0] + ab[1] in kept]
        elif key.endswith("_token_id") and int(value) >= n_vocab:
            continue
        out.append((key, value, vtype, sub))
    return tuple(out)


def _n_vocab(tok: Sequence[Field]) -> int:
    for key, value, _, _ in tok:
        if key == "tokenizer.ggml.tokens":
            return len(value)
    raise ValueError("tokenizer metadata has no tokenizer.ggml.tokens")


def make_tiny_model(
    path: Path,
    arch: str,
    *,
    n_layer: int,
    tokenizer_from: Path,
    n_vocab: int | None = None,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    seed: int = 0,
    token_embd_type: str = "Q8_0",
    weight_type: str = "F32",
    rope_freq_base: float | None = None,
    sliding_window: int = 8,
    swa_pattern: int | Sequence[bool] | None = None,
    tied: bool | None = None,
    output_type: str | None = None,
    extra_kv: Mapping[str, Any] | None = None,
) -> Path:
    """Write a small random-weight GGUF of ``arch`` that llama.cpp loads and runs.

    ``arch`` is a llama.cpp architecture (llama, qwen2, qwen3, gemma3) or
    "mistral": llama's graph with GQA (n_head_kv < n_head), rope base 1e6 and
    an untied ``output.weight``, as Mistral 7B ships. ``tokenizer_from`` is a
    GGUF whose ``tokenizer.*`` keys are copied; ``n_vocab`` keeps only its first
    n_vocab tokens (see ``truncated_vocab``), None keeps all. For gemma3, ``sliding_window``
    is written as ``gemma3.attention.sliding_window`` (0: no sliding window)
    and ``swa_pattern`` as ``...sliding_window_pattern`` (None: not written,
    so llama.cpp's default of every 6th layer global applies; an int period;
    or explicit per-layer flags); other archs get no window unless ``extra_kv``
    adds one. ``extra_kv`` adds or replaces metadata keys (bool, int as
    uint32, float as float32, str, or a list). ``tied`` (default: all but
    mistral) leaves out ``output.weight`` so the lm_head is ``token_embd``;
    an untied ``output.weight`` is of ``output_type`` (default ``weight_type``).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; one of {ARCHS}")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    mistral = arch == "mistral"
    gguf_arch = "llama" if mistral else arch
    if tied is None:
        tied = not mistral
    if rope_freq_base is None:
        rope_freq_base = {"mistral": 1e6, "qwen2": 1e6, "qwen3": 1e6, "gemma3": 1e6}.get(arch, 1e4)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    tok = tokenizer_fields(tokenizer_from)
    if n_vocab is not None:
        tok = truncated_vocab(tok, n_vocab)
    n_vocab = _n_vocab(tok)
    rng = np.random.default_rng(seed)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, gguf_arch)
    a = gguf_arch
    w.add_string("general.name", f"tiny-{arch}-{n_layer}L-s{seed}")
    w.add_uint32(f"{a}.block_count", n_layer)
    w.add_uint32(f"{a}.context_length", 2048)
    w.add_uint32(f"{a}.embedding_length", n_embd)
    w.add_uint32(f"{a}.feed_forward_length", n_ff)
    w.add_uint32(f"{a}.attention.head_count", n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if a != "llama" else 1e-5)
    w.add_float32(f"{a}.rope.freq_base", float(rope_freq_base))
    w.add_uint32(f"{a}.vocab_size", n_vocab)
    if a == "llama":
        w.add_uint32(f"{a}.rope.dimension_count", head_dim)
    if a == "gemma3":
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
        if sliding_window:
            w.add_uint32(f"{a}.attention.sliding_window", sliding_window)
            # gemma3's local layers use a different rope base than its global ones
            w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
        if isinstance(swa_pattern, int):
            w.add_uint32(f"{a}.attention.sliding_window_pattern", swa_pattern)
        elif swa_pattern is not None:
            if len(swa_pattern) != n_layer:
                raise ValueError("swa_pattern needs one flag per layer")
            w.add_array(f"{a}.attention.sliding_window_pattern", [bool(x) for x in swa_pattern])
    w.add_uint32("general.file_type", _FTYPES[weight_type])
    w.add_uint32("general.quantization_version", 2)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    for key, value in (extra_kv or {}).items():
        w.kv_data[0].pop(key, None)  # replace, without the writer's duplicate-key warning
        _add_inferred(w, key, value)

    def add(name: str, arr: np.ndarray, qtype: str) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        qt = _QTYPES[qtype]
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            q = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)

    def weight(out_dim: int, in_dim: int) -> np.ndarray:
        # numpy (out, in) is ggml {in, out}: y = W x
        return rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.float32(np.sqrt(in_dim))

    def norm(dim: int) -> np.ndarray:
        return np.float32(1.0) + np.float32(0.1) * rng.standard_normal(dim, dtype=np.float32)

    def bias(dim: int) -> np.ndarray:
        return np.float32(0.1) * rng.standard_normal(dim, dtype=np.float32)

    add("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32), token_embd_type)
    add("output_norm.weight", norm(n_embd), "F32")
    if not tied:
        add("output.weight", weight(n_vocab, n_embd), output_type or weight_type)
    for i in range(n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(n_embd), "F32")
        add(p + "attn_q.weight", weight(n_embd, n_embd), weight_type)
        add(p + "attn_k.weight", weight(n_embd_kv, n_embd), weight_type)
        add(p + "attn_v.weight", weight(n_embd_kv, n_embd), weight_type)
        if a == "qwen2":
            add(p + "attn_q.bias", bias(n_embd), "F32")
            add(p + "attn_k.bias", bias(n_embd_kv), "F32")
            add(p + "attn_v.bias", bias(n_embd_kv), "F32")
        if a in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", norm(head_dim), "F32")
            add(p + "attn_k_norm.weight", norm(head_dim), "F32")
        add(p + "attn_output.weight", weight(n_embd, n_embd), weight_type)
        if a == "gemma3":
            add(p + "post_attention_norm.weight", norm(n_embd), "F32")
        add(p + "ffn_norm.weight", norm(n_embd), "F32")
        add(p + "ffn_gate.weight", weight(n_ff, n_embd), weight_type)
        add(p + "ffn_up.weight", weight(n_ff, n_embd), weight_type)
        add(p + "ffn_down.weight", weight(n_embd, n_ff), weight_type)
        if a == "gemma3":
            add(p + "post_ffw_norm.weight", norm(n_embd), "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path
