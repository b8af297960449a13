"""An untied model's tail carries its lm_head as ``token_embd``, and computes exactly what the whole model does.

A tail's input is a residual, so it never reads token rows; for a model with
a separate ``output.weight`` the slicer writes that matrix (its bytes and
ggml type) as the tail's ``token_embd`` and leaves ``output.weight`` out, so
the tail maps one vocabulary-sized matrix instead of two. llama.cpp's loader
(``load_arch_tensors`` of llama, qwen2, qwen3 and gemma3) then takes
``token_embd`` as the lm_head with ``TENSOR_DUPLICATED``, and
``llama_model_loader::create_tensor`` places that duplicate as the output
tensor: the buffer type, and so the matmul kernel, a real ``output.weight``
gets. These tests check the file (no ``output.weight``; ``token_embd`` has
``output.weight``'s digest and type; the manifest and integrity check agree)
and the numbers: tiny untied models of each architecture, with output types
that differ from their ``token_embd``'s, among them Q4_0 (which llama.cpp
repacks for its CPU_REPACK kernel on AVX2, in the whole model and in the
tail), generate through head -> tail with the tail's logits equal, bit for
bit, to the whole model's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import pytest

from meshnode.gguf import slicer
from meshnode.gguf.integrity import verify_artifact
from meshnode.gguf.meta import TensorInfo, read_meta
from meshnode.gguf.model import fingerprint
from meshnode.gguf.slicer import Role, ensure_range, range_digest, tensor_sha256, ties_output
from tests.conftest import llama_reference
from tests.test_arch_parity import (
    N_DECODE,
    N_LAYER,
    N_VOCAB,
    PROMPT,
    Run,
    assert_same_run,
    run_chain,
    run_whole,
    whole_run,
)
from tests.tinymodels import make_tiny_model

#: name -> make_tiny_model keyword arguments; every one untied, its output of another type than token_embd's
#: (Q8_0 unless said), except qwen3's (F32 token_embd, Q8_0 output)
UNTIED: dict[str, dict[str, Any]] = {
    # Q4_0 output: repacked (q4_0_8x8, CPU_REPACK) on AVX2, both in the whole model and in the tail
    "llama-q4_0": {"arch": "llama", "n_head_kv": 4, "weight_type": "Q8_0", "output_type": "Q4_0", "seed": 5},
    "qwen2-f16": {"arch": "qwen2", "output_type": "F16", "seed": 6},
    "qwen3-q8_0": {"arch": "qwen3", "output_type": "Q8_0", "token_embd_type": "F32", "seed": 7},
    "gemma3-f32": {"arch": "gemma3", "n_embd": 96, "sliding_window": 8, "output_type": "F32", "seed": 8},
}

CUTS = [[(0, 5), (5, 12)], [(0, 1), (1, 11), (11, 12)]]


@pytest.fixture(scope="module")
def untied(model: Path, tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """untied(name, **overrides) -> path of an untied tiny model, built once per module."""
    root = tmp_path_factory.mktemp("untied-models")
    built: dict[str, Path] = {}

    def make(name: str, **overrides: Any) -> Path:
        kwargs = {"n_layer": N_LAYER, "n_vocab": N_VOCAB, "tied": False, **UNTIED[name], **overrides}
        key = "-".join(f"{k}={kwargs[k]}" for k in sorted(kwargs))
        if key not in built:
            arch = kwargs.pop("arch")
            built[key] = make_tiny_model(root / f"{name}-{len(built)}.gguf", arch, tokenizer_from=model, **kwargs)
        return built[key]

    return make


def _tensors(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(path, "r").tensors}


def _bytes(t: Any) -> np.ndarray:
    return np.asarray(t.data).view(np.uint8)


def _source_name(name: str, start: int) -> str:
    """The source tensor a range's tensor ``name`` was copied from (blk.N of a range is blk.N+start)."""
    if not name.startswith("blk."):
        return name
    _, idx, rest = name.split(".", 2)
    return f"blk.{int(idx) + start}.{rest}"


# -- the file ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(UNTIED))
def test_untied_tail_carries_output_as_token_embd(untied, name):
    path = untied(name)
    src = _tensors(path)
    assert "output.weight" in src
    assert src["output.weight"].tensor_type != src["token_embd.weight"].tensor_type
    head, middle, tail = (ensure_range(path, a, b) for a, b in [(0, 5), (5, 9), (9, 12)])
    assert tail.role is Role.TAIL

    out = _tensors(tail.range_path)
    assert "output.weight" not in out
    lm_head = out["token_embd.weight"]
    assert lm_head.tensor_type == src["output.weight"].tensor_type
    assert lm_head.shape.tolist() == src["output.weight"].shape.tolist() == [UNTIED[name].get("n_embd", 64), N_VOCAB]
    assert tensor_sha256(lm_head) == tensor_sha256(src["output.weight"])
    assert tensor_sha256(lm_head) != tensor_sha256(src["token_embd.weight"])
    # every other tensor is the source's, bytes unchanged
    for t_name, t in out.items():
        if t_name == "token_embd.weight":
            continue
        assert np.array_equal(_bytes(t), _bytes(src[_source_name(t_name, 9)])), t_name
    assert len(out) == 2 + sum(1 for n in src if n.startswith(("blk.9.", "blk.10.", "blk.11.")))

    # the manifest lists what the file holds, under the file's names, and says where token_embd came from
    m = json.loads((tail.dir / "manifest.json").read_text())
    assert m["token_embd_is_output"] is True
    assert m["slicer"] == slicer.SLICER_VERSION
    assert set(m["tensors"]) == set(out)
    assert m["tensors"]["token_embd.weight"]["sha256"] == tensor_sha256(src["output.weight"])
    assert m["tensors"]["token_embd.weight"]["type"] == src["output.weight"].tensor_type.name
    for t_name, t in out.items():
        assert m["tensors"][t_name]["sha256"] == tensor_sha256(t)
    assert m["range_digest"] == range_digest(m["tensors"]) == tail.range_digest
    verify_artifact(tail)  # the integrity check a node runs before serving: passes

    # the head and middles are untouched: the head looks up the real token embeddings
    assert head.manifest["token_embd_is_output"] is False
    assert middle.manifest["token_embd_is_output"] is False
    assert head.vocab_path is not None
    assert tensor_sha256(_tensors(head.vocab_path)["token_embd.weight"]) == tensor_sha256(src["token_embd.weight"])
    for art in (head, middle):
        assert "output.weight" not in _tensors(art.range_path)
        assert _tensors(art.range_path)["token_embd.weight"].shape.tolist()[1] == 1
        verify_artifact(art)


# -- the numbers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cut"),
    [(name, cut) for name in UNTIED for cut in CUTS],
    ids=lambda v: "_".join(f"{a}-{b}" for a, b in v) if isinstance(v, list) else v,
)
def test_untied_tail_equals_whole(untied, name, cut):
    path = untied(name)
    tail = ensure_range(path, *cut[-1])
    assert tail.manifest["token_embd_is_output"] is True
    assert_same_run(run_chain(path, cut), whole_run(path))


def test_untied_whole_equals_llama(untied):
    """The reference of the route test, the whole model as one LlamaRange, is llama-cpp-python's Llama."""
    path = untied("llama-q4_0")
    ref = llama_reference(path, PROMPT, N_DECODE + 1)
    assert_same_run(whole_run(path), Run(ref.prompt_tokens, ref.tokens, ref.logits))


def test_repacked_lm_head_is_what_the_tail_computes_with(untied, monkeypatch):
    """The Q4_0 lm_head's kernel shows in the logits, so the tail's exactness is that of the same kernel.

    Loaded without llama.cpp's extra buffer types (no CPU_REPACK), the whole
    model's logits differ from its own with them; the route's tail, whose
    lm_head is its token_embd, equals the repacked whole model exactly
    (test_untied_tail_equals_whole), so it gets the repacked kernel too.
    """
    path = untied("llama-q4_0")
    repacked = whole_run(path)
    default_params = llama_cpp.llama_model_default_params

    def no_repack() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    monkeypatch.setattr(llama_cpp, "llama_model_default_params", no_repack)
    plain = run_whole(path)
    if all(np.array_equal(a, b) for a, b in zip(plain.logits, repacked.logits, strict=True)):
        pytest.skip("this CPU has no repacked Q4_0 kernel: both loads compute alike")
    monkeypatch.undo()
    chain = run_chain(path, CUTS[0])
    assert_same_run(chain, repacked)
    assert not all(np.array_equal(a, b) for a, b in zip(chain.logits, plain.logits, strict=True))


# -- when it applies -----------------------------------------------------------------------------------------


def test_ties_output_only_where_the_loader_falls_back(untied, model):
    path = untied("llama-q4_0")
    meta = read_meta(path)
    assert ties_output(meta, "llama")
    # tied models (the default one) have no output.weight: nothing to move
    assert not ties_output(read_meta(model), "llama")
    # an architecture meshnode does not cut
    assert not ties_output(meta, "gemma2")
    out = next(t for t in meta.tensors if t.name == "output.weight")

    def with_tensors(*extra: TensorInfo, drop: str = "") -> Any:
        return dataclasses.replace(meta, tensors=[t for t in meta.tensors if t.name != drop] + list(extra))

    # NVFP4 scale tensors name the output tensor: llama.cpp asserts a tied NVFP4 output has none
    assert not ties_output(with_tensors(dataclasses.replace(out, name="output.scale", shape=(1,))), "llama")
    # qwen2's output bias is read beside whichever matrix is the lm_head
    assert ties_output(with_tensors(dataclasses.replace(out, name="output.bias", shape=(N_VOCAB,))), "qwen2")
    # an output matrix of another shape than token_embd's would not load as token_embd
    assert not ties_output(with_tensors(dataclasses.replace(out, shape=(64, 512)), drop="output.weight"), "llama")
    assert not ties_output(with_tensors(dataclasses.replace(out, type=gguf.GGMLQuantizationType.NVFP4),
                                        drop="output.weight"), "llama")
    # a per-tensor precision table is keyed by tensor name
    prec = dataclasses.replace(meta, fields={**meta.fields, "general.tensor_extra.name": ["output.weight"]})
    assert not ties_output(prec, "llama")


def test_cut_of_another_slicer_version_is_never_reused(untied, monkeypatch):
    """The slicer version is part of the artifact's directory, and a manifest of another version is recut."""
    path = untied("qwen3-q8_0")
    fp = fingerprint(path)
    tail = ensure_range(path, 9, 12)
    assert tail.dir == slicer.artifact_dir(fp, 9, 12)
    assert tail.dir.name == f"9-12.s{slicer.SLICER_VERSION}"
    # an older slicer's directory (whose tail would still carry output.weight) is not where this one looks
    monkeypatch.setattr(slicer, "SLICER_VERSION", slicer.SLICER_VERSION - 1)
    old_dir = slicer.artifact_dir(fp, 9, 12)
    assert old_dir != tail.dir
    assert slicer.cached_range(path, 9, 12) is None
    monkeypatch.undo()
    # a manifest of another version inside this version's directory: cut again, never served as it is
    mpath = tail.dir / "manifest.json"
    m = json.loads(mpath.read_text())
    m["slicer"] = slicer.SLICER_VERSION - 1
    mpath.write_text(json.dumps(m))
    assert slicer.cached_range(path, 9, 12) is None
    again = ensure_range(path, 9, 12)
    assert again.manifest["slicer"] == slicer.SLICER_VERSION
    assert again.manifest["token_embd_is_output"] is True
    assert again.range_digest == tail.range_digest  # deterministic: the same bytes again
