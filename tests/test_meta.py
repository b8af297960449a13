"""The small GGUF metadata reader (meshnode/gguf/meta.py) against gguf-py's GGUFReader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from meshnode.errors import ModelFormatError
from meshnode.gguf.meta import ArrayInfo, read_meta, tensor_data


@pytest.fixture(scope="module")
def reader(model):
    return gguf.GGUFReader(model, "r")


def test_fields_and_tensors_equal_gguf_py(model, reader):
    meta = read_meta(model)
    full = read_meta(model, full=True)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(meta.fields) == keys
    skipped = 0
    for key in keys:
        field = reader.fields[key]
        want = field.contents()
        assert full.fields[key] == want, key
        assert full.types[key][0] == field.types[0]
        if isinstance(meta.fields[key], ArrayInfo):
            skipped += 1
            assert meta.fields[key].count == len(want)
        else:
            assert meta.fields[key] == want, key
    assert skipped == 3  # tokens, token types, merges: the vocabulary is not decoded by default
    assert [(t.name, t.offset, t.n_bytes, t.type, t.shape) for t in meta.tensors] == [
        (t.name, t.data_offset, t.n_bytes, t.tensor_type, tuple(int(x) for x in t.shape)) for t in reader.tensors
    ]


def test_tensor_data_is_what_gguf_py_maps(model, reader):
    meta = read_meta(model)
    by_name = {t.name: t for t in reader.tensors}
    for t in meta.tensors[:6] + meta.tensors[-3:]:
        got, want = tensor_data(model, t), by_name[t.name].data
        assert got.shape == want.shape
        assert got.dtype == want.dtype
        assert np.array_equal(got, want)


def test_damaged_files_are_model_format_errors(model, tmp_path):
    head = model.read_bytes()[: 1 << 16]  # the header and part of the metadata
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(ModelFormatError, match=r"damaged|truncated"):
        read_meta(cut)
    whole = model.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(ModelFormatError, match="truncated"):
        read_meta(short)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelFormatError, match="damaged"):
        read_meta(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError):
        read_meta(empty)
