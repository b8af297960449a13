"""The head's token-row dequantizer (meshnode/gguf/rows.py) against the gguf package's, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from meshnode.gguf.rows import Q8_0_BYTES, dequantize_rows

Q = gguf.GGMLQuantizationType


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _q8_0_rows(rng: np.random.Generator, n: int, blocks: int) -> np.ndarray:
    raw = rng.integers(0, 256, size=(n, blocks, Q8_0_BYTES), dtype=np.uint8)
    scales = rng.standard_normal((n, blocks)).astype(np.float16)
    # scales ggml meets in real files and at the edges: zero, -0, subnormal, tiny, huge, inf, nan
    edge = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, np.inf, -np.inf, np.nan], dtype=np.float16)
    scales.flat[: edge.size] = edge
    raw[:, :, :2] = scales.view(np.uint8).reshape(n, blocks, 2)
    raw[0, 0, 2:4] = [0x80, 0x7F]  # int8 -128 and 127
    return raw.reshape(n, blocks * Q8_0_BYTES)


@pytest.mark.parametrize("blocks", [1, 18, 64])  # n_embd 32, 576 (SmolLM2), 2048 (bench.synth)
def test_q8_0_rows_equal_the_gguf_package_bit_for_bit(blocks: int) -> None:
    rows = _q8_0_rows(np.random.default_rng(blocks), 40, blocks)
    with np.errstate(invalid="ignore"):  # an infinite scale times a zero quant is nan, in both
        got = dequantize_rows(rows, Q.Q8_0)
        want = gguf.quants.dequantize(rows, Q.Q8_0)
    assert got.dtype == np.float32
    assert got.shape == (40, 32 * blocks)
    assert np.array_equal(_bits(got), _bits(want))


def test_one_row_picked_from_a_table_keeps_its_shape() -> None:
    table = _q8_0_rows(np.random.default_rng(7), 100, 4)
    tokens = np.array([5], dtype=np.int32)
    got = dequantize_rows(table[tokens], Q.Q8_0)
    assert got.shape == (1, 128)
    assert np.array_equal(_bits(got), _bits(gguf.quants.dequantize(table[5:6], Q.Q8_0)))


@pytest.mark.parametrize(("qtype", "dtype"), [(Q.F32, np.float32), (Q.F16, np.float16)])
def test_float_rows_widen_exactly(qtype: gguf.GGMLQuantizationType, dtype: type) -> None:
    values = np.random.default_rng(3).standard_normal((6, 64)).astype(dtype)
    values[0, :3] = [np.inf, -np.inf, np.nan]
    got = dequantize_rows(values.view(np.uint8), qtype)
    assert np.array_equal(_bits(got), _bits(values.astype(np.float32)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.BF16])
def test_other_types_go_to_the_gguf_package(qtype: gguf.GGMLQuantizationType) -> None:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = np.random.default_rng(11).integers(0, 256, size=(3, 8 * size), dtype=np.uint8)
    if qtype != Q.BF16:  # keep the fp16 scales finite
        r = rows.reshape(3, 8, size)
        r[:, :, :2] = np.array([0.5], dtype=np.float16).view(np.uint8)
        if qtype == Q.Q4_1:
            r[:, :, 2:4] = np.array([-0.25], dtype=np.float16).view(np.uint8)
    got = dequantize_rows(rows, qtype)
    assert got.shape == (3, 8 * block)
    assert np.array_equal(_bits(got), _bits(gguf.quants.dequantize(rows, qtype)))
