"""Range artifacts of the default model: bytes unchanged, manifest, reuse, vocab."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnode import errors
from meshnode.gguf import ensure_range
from meshnode.gguf.model import file_sha256, fingerprint
from meshnode.gguf.slicer import SLICER_VERSION, Role, range_digest, tensor_sha256
from meshnode.models import DEFAULT_MODEL


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path, "r").tensors}


def test_default_model_is_the_verified_file(model):
    assert file_sha256(model) == DEFAULT_MODEL.sha256


def test_middle_range_copies_layer_bytes_unchanged_and_renumbers(model):
    art = ensure_range(model, 10, 22)
    assert art.role is Role.MIDDLE
    src, out = _tensors(model), _tensors(art.range_path)
    for i in range(12):
        for suffix in ("attn_q.weight", "ffn_down.weight", "attn_norm.weight"):
            a, b = src[f"blk.{i + 10}.{suffix}"], out[f"blk.{i}.{suffix}"]
            assert a.tensor_type == b.tensor_type
            assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))
    assert not any(n.startswith("blk.12.") for n in out)
    # a middle never computes the lm_head and never reads the vocabulary
    assert "output.weight" not in out
    assert out["token_embd.weight"].shape.tolist() == [576, 1]
    reader = gguf.GGUFReader(art.range_path, "r")
    assert reader.fields["llama.block_count"].contents() == 12
    assert reader.fields["tokenizer.ggml.model"].contents() == "none"
    assert art.range_path.stat().st_size < 0.3 * model.stat().st_size


def test_manifest_binds_source_range_and_every_tensor(model):
    art = ensure_range(model, 15, 30)
    m = json.loads((art.dir / "manifest.json").read_text())
    assert m["source"]["fingerprint"] == fingerprint(model)  # the model id (meshnode/modelid)
    assert m["range"] == [15, 30]
    assert m["role"] == "tail"
    out = _tensors(art.range_path)
    assert set(m["tensors"]) == set(out)
    for name, t in out.items():
        assert m["tensors"][name]["sha256"] == tensor_sha256(t)
    assert m["range_digest"] == range_digest(m["tensors"])
    # the tail keeps the full vocabulary for its lm_head (tied to token_embd): the source's own
    # token_embd, bytes unchanged (only an untied model's tail carries output.weight there instead)
    assert out["token_embd.weight"].shape.tolist() == [576, 49152]
    assert "output.weight" not in out
    assert tensor_sha256(out["token_embd.weight"]) == tensor_sha256(_tensors(model)["token_embd.weight"])
    assert m["token_embd_is_output"] is False
    assert art.dir.name == f"15-30.s{SLICER_VERSION}"


def test_head_carries_its_token_table_unchanged(model):
    art = ensure_range(model, 0, 15)
    assert art.role is Role.HEAD
    assert art.vocab_path is not None
    src = _tensors(model)["token_embd.weight"]
    table = _tensors(art.vocab_path)["token_embd.weight"]
    assert tensor_sha256(table) == tensor_sha256(src)
    assert art.manifest["vocab_tensors"]["token_embd.weight"]["sha256"] == tensor_sha256(src)


def test_work_already_done_is_not_redone(model):
    first = ensure_range(model, 3, 9)
    stamp = (first.range_path.stat().st_mtime_ns, (first.dir / "manifest.json").stat().st_mtime_ns)
    again = ensure_range(model, 3, 9)
    assert again.dir == first.dir
    assert (again.range_path.stat().st_mtime_ns, (again.dir / "manifest.json").stat().st_mtime_ns) == stamp


def test_whole_model_is_the_source_itself(model):
    art = ensure_range(model, 0, 30)
    assert art.role is Role.WHOLE
    assert art.range_path == model


@pytest.mark.parametrize(("a", "b"), [(0, 31), (5, 5), (7, 3), (-1, 4)])
def test_bad_ranges_are_refused(model, a, b):
    with pytest.raises(errors.LayerRangeError):
        ensure_range(model, a, b)


def test_a_settled_file_keeps_its_bytes_and_is_read_back_whole(tmp_path: Path) -> None:
    """gguf/pages.py: a cut file is synced, its pages dropped and read back; its bytes do not change
    (where its pages then sit is a benchmark's matter: bench.ranges)."""
    from meshnode.gguf.pages import CHUNK, settle

    data = os.urandom(CHUNK + 12345)  # more than one read back
    path = tmp_path / "range.gguf"
    path.write_bytes(data)
    settle(path)
    assert path.read_bytes() == data
    with pytest.raises(FileNotFoundError):
        settle(tmp_path / "missing.gguf")
