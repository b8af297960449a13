"""A synthetic llama-architecture GGUF whose weights dominate a process: ``python -m bench.synth``.

The default model (SmolLM2-135M, 98 MB of weights) is smaller than a node's Python runtime, so no split by
layers can show memory that scales with the range. This writes a random-weight llama model of at least
``--size-gb`` GiB instead (default 1.0): TinyLlama-1.1B's widths (n_embd 2048, n_ff 5632, 32 query heads,
4 KV heads), an untied ``output.weight``, and as many layers as the size needs, rounded up to a multiple of 6
so that halves and thirds cut evenly (Q8_0, 1 GiB: 24 layers, 1.34 GB). The tokenizer is the default
model's own (``meshnode.models.pull()``: SmolLM2's gpt2-style BPE, 49152 tokens), copied key for key as
tests/tinymodels.py does, so llama.cpp loads the file and ``meshnode generate`` tokenizes for it.

Weights: N(0, 0.02^2) for every matrix (token_embd and output included), norms exactly 1, drawn from one
``numpy.random.Generator`` (PCG64, ``--seed``) tensor by tensor in file order, in fixed-size row blocks:
the same parameters give the same bytes. Activations stay O(1): a 2048-wide dot product of N(0, 0.02^2)
weights with unit-RMS input has std ~0.9.

Stored as Q8_0 (default; llama.cpp's fast 8-bit CPU type, written with ``gguf.quants.quantize``) or F16
(``--type f16``: twice the bytes for the same shape). Streaming: tensor infos first, then each tensor's
bytes one tensor at a time (the biggest, token_embd, is 107 MB in Q8_0), into a temporary file renamed
into place at the end. Cached under ``meshnode.runtime.paths.cache_dir()/bench`` (``${XDG_CACHE_HOME:-~/.cache}/
meshnode/bench``) by a key of every parameter, and reused when a file of that key is present and its
metadata, tensor table and size check out; ``--out PATH`` writes (or reuses) that path instead.

``--arch qwen3moe`` writes a mixture-of-experts model of Qwen3-30B-A3B's shape instead (n_embd 2048, 32
query and 4 KV heads of 128, q/k norms, experts of width 768 with 8 used per token; 64 experts a layer
instead of 128, and as few layers as the size needs, a multiple of 6): with ``--size-gb 3`` 12 layers,
4.3 GB, the experts 87% of the bytes; the router is F32 as in Qwen's own files.

Reproduce: ``.venv/bin/python -m bench.synth`` (prints the path on stdout; progress on stderr);
``.venv/bin/python -m bench.synth --arch qwen3moe --size-gb 3``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshnode.gguf.pages import settle

#: bump when the bytes written for the same parameters change
FORMAT = 1
ARCHS = ("llama", "qwen3moe")
GIB = 1 << 30
#: values drawn and quantized at a time (64 MB of float32)
BLOCK_VALUES = 1 << 24
KEY_FIELD = "meshnode.bench.synth_key"
TYPES = ("q8_0", "f16")


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int = 2048
    n_ff: int = 5632
    n_head: int = 32
    n_head_kv: int = 4
    n_vocab: int = 49152
    n_ctx_train: int = 2048
    type: str = "q8_0"
    seed: int = 0
    arch: str = "llama"
    #: qwen3moe only: experts per layer, used per token, and their width; per-head width
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.n_head_dim or self.n_embd // self.n_head

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        """(name, numpy shape (…, rows, row length), is F32) in file order; numpy (out, in) is ggml {in, out}."""
        e, kv, ff = self.n_embd, self.head_dim * self.n_head_kv, self.n_ff
        yield "token_embd.weight", (self.n_vocab, e), False
        yield "output_norm.weight", (e,), True
        yield "output.weight", (self.n_vocab, e), False
        if self.arch == "qwen3moe":
            yield from self._moe_layers()
            return
        for i in range(self.n_layer):
            p = f"blk.{i}."
            yield p + "attn_norm.weight", (e,), True
            yield p + "attn_q.weight", (e, e), False
            yield p + "attn_k.weight", (kv, e), False
            yield p + "attn_v.weight", (kv, e), False
            yield p + "attn_output.weight", (e, e), False
            yield p + "ffn_norm.weight", (e,), True
            yield p + "ffn_gate.weight", (ff, e), False
            yield p + "ffn_up.weight", (ff, e), False
            yield p + "ffn_down.weight", (e, ff), False

    def _moe_layers(self) -> Iterator[tuple[str, tuple[int, ...], bool]]:
        """qwen3moe's layer (llama.cpp src/models/qwen3moe.cpp ``load_arch_tensors``)."""
        e, hd, x, fe = self.n_embd, self.head_dim, self.n_expert, self.n_ff_exp
        q, kv = hd * self.n_head, hd * self.n_head_kv
        for i in range(self.n_layer):
            p = f"blk.{i}."
            yield p + "attn_norm.weight", (e,), True
            yield p + "attn_q.weight", (q, e), False
            yield p + "attn_k.weight", (kv, e), False
            yield p + "attn_v.weight", (kv, e), False
            yield p + "attn_output.weight", (e, q), False
            yield p + "attn_k_norm.weight", (hd,), True
            yield p + "attn_q_norm.weight", (hd,), True
            yield p + "ffn_norm.weight", (e,), True
            yield p + "ffn_gate_inp.weight", (x, e), True  # the router, F32
            yield p + "ffn_gate_exps.weight", (x, fe, e), False
            yield p + "ffn_down_exps.weight", (x, e, fe), False
            yield p + "ffn_up_exps.weight", (x, fe, e), False

    def nbytes(self, shape: tuple[int, ...], norm: bool) -> int:
        n = math.prod(shape)
        if norm:
            return 4 * n  # F32
        return n * 2 if self.type == "f16" else n // 32 * 34  # Q8_0: 32 int8 + one f16 scale per block

    def total_bytes(self) -> int:
        return sum(self.nbytes(s, norm) for _, s, norm in self.tensors())


#: Qwen3-30B-A3B's widths (its GGUF's qwen3moe.* keys), with 64 experts a layer instead of 128
MOE_WIDTHS: dict[str, Any] = {"arch": "qwen3moe", "n_expert": 64, "n_expert_used": 8, "n_ff_exp": 768,
                              "n_head_dim": 128, "n_ff": 6144, "n_ctx_train": 40960}


def shape_for(size_gb: float, *, type: str = "q8_0", seed: int = 0, n_vocab: int = 49152,
              n_layer: int | None = None, arch: str = "llama") -> Shape:
    """The default widths with the fewest layers (a multiple of 6) whose weights reach ``size_gb`` GiB."""
    widths = MOE_WIDTHS if arch == "qwen3moe" else {}
    if n_layer is not None:
        return Shape(n_layer=n_layer, type=type, seed=seed, n_vocab=n_vocab, **widths)
    n = 6
    while Shape(n_layer=n, type=type, seed=seed, n_vocab=n_vocab, **widths).total_bytes() < size_gb * GIB:
        n += 6
    return Shape(n_layer=n, type=type, seed=seed, n_vocab=n_vocab, **widths)


def tokenizer_fields(source: Path) -> list[tuple[str, Any, Any, Any]]:
    """Every ``tokenizer.*`` key of ``source`` as (key, value, type, element type); meshnode's own fast
    metadata reader with arrays decoded (gguf-py's GGUFReader takes ~2 s on this vocabulary)."""
    from meshnode.gguf.meta import read_meta

    meta = read_meta(source, full=True)
    out = [(k, v, *meta.types[k]) for k, v in meta.fields.items() if k.startswith("tokenizer.")]
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return out


def cache_key(shape: Shape, tokenizer_sha256: str) -> str:
    blob = json.dumps({"format": FORMAT, "shape": asdict(shape), "tokenizer": tokenizer_sha256}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_path(shape: Shape, key: str) -> Path:
    from meshnode.runtime.paths import cache_dir

    name = f"synth-{shape.arch}-{shape.n_embd}x{shape.n_layer}-{shape.type}-s{shape.seed}-{key}.gguf"
    return cache_dir() / "bench" / name


def is_valid(path: Path, shape: Shape, key: str) -> bool:
    """A complete file of this key: the key in its metadata, every tensor of the shape, and its last tensor
    ends inside the file (meshnode's reader refuses truncated files)."""
    from meshnode.errors import ModelFormatError
    from meshnode.gguf.meta import read_meta

    if not path.is_file():
        return False
    try:
        meta = read_meta(path)
    except ModelFormatError:
        return False
    names = [name for name, _, _ in shape.tensors()]
    return meta.get(KEY_FIELD) == key and [t.name for t in meta.tensors] == names


def _progress(msg: str) -> None:
    print(f"bench.synth: {msg}", file=sys.stderr, flush=True)


def write_model(path: Path, shape: Shape, key: str, tokenizer: list[tuple[str, Any, Any, Any]]) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType.Q8_0 if shape.type == "q8_0" else gguf.GGMLQuantizationType.F16
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    a = shape.arch
    w = gguf.GGUFWriter(tmp, a)
    w.add_string("general.name", f"synth-{a}-{shape.n_embd}x{shape.n_layer}-{shape.type}-s{shape.seed}")
    w.add_string(KEY_FIELD, key)
    w.add_uint32(f"{a}.block_count", shape.n_layer)
    w.add_uint32(f"{a}.context_length", shape.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", shape.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", shape.n_ff)
    w.add_uint32(f"{a}.attention.head_count", shape.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", shape.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5 if a == "llama" else 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 10000.0 if a == "llama" else 1e6)
    w.add_uint32(f"{a}.rope.dimension_count", shape.head_dim)
    if a == "qwen3moe":
        w.add_uint32(f"{a}.attention.key_length", shape.head_dim)
        w.add_uint32(f"{a}.attention.value_length", shape.head_dim)
        w.add_uint32(f"{a}.expert_count", shape.n_expert)
        w.add_uint32(f"{a}.expert_used_count", shape.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", shape.n_ff_exp)
    w.add_uint32(f"{a}.vocab_size", shape.n_vocab)
    w.add_uint32("general.file_type", 7 if shape.type == "q8_0" else 1)  # LLAMA_FTYPE_MOSTLY_Q8_0 / _F16
    w.add_uint32("general.quantization_version", 2)
    for k, value, vtype, sub in tokenizer:
        w.add_key_value(k, value, vtype, sub)

    plan = list(shape.tensors())
    for name, s, norm in plan:
        nbytes = shape.nbytes(s, norm)
        if norm:
            w.add_tensor_info(name, s, np.dtype(np.float32), nbytes)
        elif shape.type == "f16":
            w.add_tensor_info(name, s, np.dtype(np.float16), nbytes)
        else:  # quantized: the byte shape (…, rows, row bytes), converted back by gguf-py
            w.add_tensor_info(name, (*s[:-1], s[-1] // 32 * 34), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    rng = np.random.default_rng(shape.seed)
    total, done, t0, last = shape.total_bytes(), 0, time.monotonic(), 0.0
    try:
        for name, s, norm in plan:
            if norm and len(s) == 1:
                w.write_tensor_data(np.ones(s, dtype=np.float32))
                done += shape.nbytes(s, norm)
                continue
            if norm:  # an F32 matrix (the router)
                w.write_tensor_data(rng.standard_normal(s, dtype=np.float32) * np.float32(0.02))
                done += shape.nbytes(s, norm)
                continue
            rows, cols = math.prod(s[:-1]), s[-1]  # quantized row by row: experts stack as rows
            out = np.empty((rows, cols * 2 if shape.type == "f16" else cols // 32 * 34), dtype=np.uint8)
            step = max(BLOCK_VALUES // cols, 1)
            for r in range(0, rows, step):
                block = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32)
                block *= np.float32(0.02)
                if shape.type == "f16":
                    out[r : r + len(block)] = block.astype(np.float16).view(np.uint8)
                else:
                    out[r : r + len(block)] = gguf.quants.quantize(block, qtype)
            w.write_tensor_data(out.reshape(*s[:-1], out.shape[-1]))
            done += out.nbytes
            del out
            now = time.monotonic()
            if now - last >= 5 or done == total:
                last = now
                _progress(f"{done / 1e6:,.0f} / {total / 1e6:,.0f} MB written ({name}, {now - t0:.0f} s)")
        w.close()
        os.replace(tmp, path)
        settle(path)  # the whole model at its fastest: its pages read back from disk (meshnode/gguf/pages.py)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise


def ensure_model(size_gb: float = 1.0, *, out: Path | None = None, type: str = "q8_0", seed: int = 0,
                 n_layer: int | None = None, arch: str = "llama") -> Path:
    """The synthetic model's path, writing it first unless a valid file of the same key is there."""
    from meshnode.models import DEFAULT_MODEL, pull

    if type not in TYPES:
        raise ValueError(f"--type must be one of {TYPES}")
    source = pull()
    tokenizer = tokenizer_fields(source)
    n_vocab = next(len(v) for k, v, *_ in tokenizer if k == "tokenizer.ggml.tokens")
    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {ARCHS}")
    shape = shape_for(size_gb, type=type, seed=seed, n_vocab=n_vocab, n_layer=n_layer, arch=arch)
    key = cache_key(shape, DEFAULT_MODEL.sha256)
    path = out if out is not None else default_path(shape, key)
    if is_valid(path, shape, key):
        return path
    _progress(f"writing {path} ({shape.total_bytes() / 1e9:.2f} GB: {shape.n_layer} layers, n_embd {shape.n_embd}, "
              f"n_ff {shape.n_ff}, {shape.n_head}/{shape.n_head_kv} heads, vocab {shape.n_vocab}, {shape.type}, "
              f"seed {shape.seed})")
    t0 = time.monotonic()
    write_model(path, shape, key, tokenizer)
    _progress(f"done in {time.monotonic() - t0:.0f} s")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.synth", allow_abbrev=False,
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", help="write (or reuse) this path instead of the cache")
    ap.add_argument("--size-gb", type=float, default=1.0, help="least size of the weights in GiB (default 1.0)")
    ap.add_argument("--type", choices=TYPES, default="q8_0", help="weight type of the matrices (default q8_0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-layer", type=int, help="layers (default: the fewest multiple of 6 reaching --size-gb)")
    ap.add_argument("--arch", choices=ARCHS, default="llama", help="llama (dense, default) or qwen3moe (experts)")
    ns = ap.parse_args(argv)
    path = ensure_model(ns.size_gb, out=Path(ns.out) if ns.out else None, type=ns.type, seed=ns.seed,
                        n_layer=ns.n_layer, arch=ns.arch)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
