"""The common part of every tiny model: keys, tokenizer, random tensors.

Weights are N(0, 1/fan_in) for matrices (experts included), N(0, 1) for
token embeddings, 1 + N(0, 0.1^2) for norms and N(0, 0.1^2) for biases, so
activations stay O(1), routers send different tokens to different experts,
and the logits of different tokens differ clearly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.tinymodels import _FTYPES, _QTYPES, _add_inferred, _n_vocab, tokenizer_fields, truncated_vocab

#: name -> builder; filled by the family modules listed in FAMILIES
BUILDERS: dict[str, Callable[[Tiny], None]] = {}
#: modules under tests/tiny/ that register builders (imported on first use)
FAMILIES = ("moe", "scaled", "windowed", "deepseek", "newer")


@dataclass
class Spec:
    """The shape of a tiny model; a builder reads what its loader needs."""

    #: general.architecture (the GGUF arch name)
    arch: str
    n_layer: int = 6
    #: keep the first n tokens of the donor's BPE vocabulary (None: all of it)
    n_vocab: int | None = 1024
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    #: per-head width (default n_embd // n_head)
    head_dim: int | None = None
    n_ff: int = 128
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    seed: int = 0
    weight_type: str = "F32"
    token_embd_type: str = "Q8_0"
    #: no output.weight: the lm_head is token_embd (where the loader allows it)
    tied: bool = True
    ctx_train: int = 2048
    rope_freq_base: float = 10000.0
    #: metadata added or replaced after the builder's own (bool, int as uint32, float as float32, str, list)
    extra_kv: dict[str, Any] = field(default_factory=dict)

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


class Tiny:
    """One model being written: ``kv``/``add`` and random tensor makers."""

    def __init__(self, path: Path, spec: Spec, tokenizer_from: Path) -> None:
        self.path, self.spec = path, spec
        self.rng = np.random.default_rng(spec.seed)
        tok = tokenizer_fields(tokenizer_from)
        if spec.n_vocab is not None:
            tok = truncated_vocab(tok, spec.n_vocab)
        self.n_vocab = _n_vocab(tok)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(path.name + ".tmp")
        self.w = gguf.GGUFWriter(self.tmp, spec.arch)
        s, a = spec, spec.arch
        self.w.add_string("general.name", f"tiny-{a}-{s.n_layer}L-s{s.seed}")
        self.kv("block_count", s.n_layer)
        self.kv("context_length", s.ctx_train)
        self.kv("embedding_length", s.n_embd)
        self.kv("feed_forward_length", s.n_ff)
        self.kv("attention.head_count", s.n_head)
        self.kv("attention.head_count_kv", s.n_head_kv)
        self.kv("rope.freq_base", float(s.rope_freq_base))
        self.kv("vocab_size", self.n_vocab)
        self.w.add_uint32("general.file_type", _FTYPES[s.weight_type])
        self.w.add_uint32("general.quantization_version", 2)
        for key, value, vtype, sub in tok:
            self.w.add_key_value(key, value, vtype, sub)

    # -- metadata ------------------------------------------------------------

    def kv(self, suffix: str, value: Any) -> None:
        """``{arch}.{suffix}`` = value (replacing an earlier one)."""
        self.put(f"{self.spec.arch}.{suffix}", value)

    def put(self, key: str, value: Any) -> None:
        self.w.kv_data[0].pop(key, None)
        _add_inferred(self.w, key, value)

    # -- tensors ---------------------------------------------------------------

    def add(self, name: str, arr: np.ndarray, qtype: str | None = None) -> None:
        """Add a tensor; numpy shape (…, out, in) is ggml {in, out, …}. Matrices get the weight type."""
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        qt = _QTYPES[qtype or (self.spec.weight_type if arr.ndim >= 2 else "F32")]
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            self.w.add_tensor(name, arr)
        elif qt == gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, arr.astype(np.float16))
        else:
            q = gguf.quants.quantize(arr, qt)
            self.w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)

    def weight(self, out_dim: int, in_dim: int, *lead: int) -> np.ndarray:
        shape = (*lead, out_dim, in_dim)
        return self.rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(in_dim))

    def norm(self, dim: int) -> np.ndarray:
        return np.float32(1.0) + np.float32(0.1) * self.rng.standard_normal(dim, dtype=np.float32)

    def bias(self, dim: int) -> np.ndarray:
        return np.float32(0.1) * self.rng.standard_normal(dim, dtype=np.float32)

    def embeddings(self) -> None:
        """token_embd, output_norm and (untied) output.weight."""
        s = self.spec
        self.add("token_embd.weight", self.rng.standard_normal((self.n_vocab, s.n_embd), dtype=np.float32),
                 s.token_embd_type)
        self.add("output_norm.weight", self.norm(s.n_embd))
        if not s.tied:
            self.add("output.weight", self.weight(self.n_vocab, s.n_embd))

    def attention(self, p: str, *, q_dim: int | None = None, kv_dim: int | None = None, bias: bool = False) -> None:
        """attn_q/k/v/output of a standard GQA block (``create_tensor_qkv`` + ``wo``)."""
        s = self.spec
        q_dim = q_dim or s.hd * s.n_head
        kv_dim = kv_dim or s.hd * s.n_head_kv
        self.add(p + "attn_q.weight", self.weight(q_dim, s.n_embd))
        self.add(p + "attn_k.weight", self.weight(kv_dim, s.n_embd))
        self.add(p + "attn_v.weight", self.weight(kv_dim, s.n_embd))
        if bias:
            self.add(p + "attn_q.bias", self.bias(q_dim))
            self.add(p + "attn_k.bias", self.bias(kv_dim))
            self.add(p + "attn_v.bias", self.bias(kv_dim))
        self.add(p + "attn_output.weight", self.weight(s.n_embd, q_dim))

    def ffn(self, p: str, n_ff: int | None = None, suffix: str = "") -> None:
        """A SwiGLU FFN: ffn_gate/up/down{suffix}."""
        s = self.spec
        n_ff = n_ff or s.n_ff
        self.add(p + f"ffn_gate{suffix}.weight", self.weight(n_ff, s.n_embd))
        self.add(p + f"ffn_up{suffix}.weight", self.weight(n_ff, s.n_embd))
        self.add(p + f"ffn_down{suffix}.weight", self.weight(s.n_embd, n_ff))

    def experts(self, p: str, n_ff_exp: int | None = None, *, gate: bool = True) -> None:
        """Router (ffn_gate_inp) and stacked experts ffn_{gate,up,down}_exps."""
        s = self.spec
        n_ff_exp = n_ff_exp or s.n_ff_exp
        self.add(p + "ffn_gate_inp.weight", self.weight(s.n_expert, s.n_embd), "F32")
        if gate:
            self.add(p + "ffn_gate_exps.weight", self.weight(n_ff_exp, s.n_embd, s.n_expert))
        self.add(p + "ffn_up_exps.weight", self.weight(n_ff_exp, s.n_embd, s.n_expert))
        self.add(p + "ffn_down_exps.weight", self.weight(s.n_embd, n_ff_exp, s.n_expert))

    def moe_keys(self) -> None:
        self.kv("expert_count", self.spec.n_expert)
        self.kv("expert_used_count", self.spec.n_expert_used)
        self.kv("expert_feed_forward_length", self.spec.n_ff_exp)

    def finish(self) -> Path:
        for key, value in self.spec.extra_kv.items():
            self.put(key, value)
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        self.tmp.replace(self.path)
        return self.path


def register(name: str, **defaults: Any) -> Callable[[Callable[[Tiny], None]], Callable[[Tiny], None]]:
    """Register ``fn`` as the builder of ``name``; ``defaults`` are its Spec fields (``arch`` at least)."""
    def deco(fn: Callable[[Tiny], None]) -> Callable[[Tiny], None]:
        fn.defaults = {"arch": name, **defaults}  # type: ignore[attr-defined]
        BUILDERS[name] = fn
        return fn

    return deco


def _load_families() -> None:
    for mod in FAMILIES:
        try:
            importlib.import_module(f"tests.tiny.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"tests.tiny.{mod}":
                raise


def make(path: Path, name: str, *, tokenizer_from: Path, **spec: Any) -> Path:
    """Build the tiny model registered as ``name``; ``spec`` fields override the builder's defaults."""
    _load_families()
    if name not in BUILDERS:
        raise ValueError(f"no tiny builder {name!r}; known: {', '.join(sorted(BUILDERS))}")
    builder = BUILDERS[name]
    defaults: dict[str, Any] = dict(getattr(builder, "defaults", {}))
    extra = {**defaults.pop("extra_kv", {}), **spec.pop("extra_kv", {})}
    t = Tiny(path, Spec(**{**defaults, **spec, "extra_kv": extra}), tokenizer_from)
    builder(t)
    return t.finish()
