"""Tensor bundles: fragments, CRC-32C, and each way a bundle can be wrong."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from meshnode import errors
from meshnode.proto import node_pb2 as pb
from meshnode.wire.tensors import crc32c, decode_bundle, encode_bundle


def test_crc32c_is_castagnoli_not_zlib():
    # RFC 3720 B.4 check value of "123456789"
    assert crc32c(b"123456789") == 0xE3069283
    assert zlib.crc32(b"123456789") != 0xE3069283


@pytest.fixture
def residual() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((7, 576)).astype(np.float32) * 1e4


def test_roundtrip_f32_is_bit_exact_across_fragments(residual):
    b = encode_bundle(residual, pos_start=5, max_chunk_bytes=1000)
    assert len(b.fragments) == -(-residual.nbytes // 1000)
    assert all(len(f.data) <= 1000 for f in b.fragments)
    out = decode_bundle(b, n_cols=576, n_rows=7, max_chunk_bytes=1000)
    assert out.dtype == np.float32
    assert np.array_equal(out, residual)
    assert b.pos_start == 5


def test_fragments_may_arrive_in_any_order(residual):
    b = encode_bundle(residual, max_chunk_bytes=4096)
    frags = list(b.fragments)[::-1]
    del b.fragments[:]
    b.fragments.extend(frags)
    assert np.array_equal(decode_bundle(b, n_cols=576), residual)


def test_f16_roundtrip_is_close_but_not_exact(residual):
    b = encode_bundle(residual, dtype=pb.DTYPE_F16)
    assert b.total_bytes == residual.size * 2
    out = decode_bundle(b, n_cols=576)
    assert not np.array_equal(out, residual)
    assert np.allclose(out, residual, rtol=1e-3)


def test_checksum_mismatch(residual):
    b = encode_bundle(residual)
    data = bytearray(b.fragments[0].data)
    data[10] ^= 0x01
    b.fragments[0].data = bytes(data)
    with pytest.raises(errors.ChecksumError):
        decode_bundle(b, n_cols=576)


@pytest.mark.parametrize("kind", ["gap", "overlap", "missing_tail", "empty", "oversized"])
def test_bad_tiling(residual, kind):
    b = encode_bundle(residual, max_chunk_bytes=4096)
    if kind == "gap":
        b.fragments[1].offset += 8
    elif kind == "overlap":
        b.fragments[1].offset -= 8
    elif kind == "missing_tail":
        del b.fragments[-1]
    elif kind == "empty":
        b.fragments.add(offset=b.total_bytes, data=b"")
    elif kind == "oversized":
        pass
    with pytest.raises(errors.TilingError):
        decode_bundle(b, n_cols=576, max_chunk_bytes=2048 if kind == "oversized" else 4096)


def test_wrong_shape_and_dtype(residual):
    b = encode_bundle(residual)
    with pytest.raises(errors.ShapeError):
        decode_bundle(b, n_cols=512)
    with pytest.raises(errors.ShapeError):
        decode_bundle(b, n_cols=576, n_rows=3)
    b.total_bytes += 4
    with pytest.raises(errors.ShapeError):
        decode_bundle(b, n_cols=576)
    b2 = encode_bundle(residual)
    b2.dtype = 7  # type: ignore[assignment]
    with pytest.raises(errors.ShapeError):
        decode_bundle(b2, n_cols=576)


def test_nan_and_inf_are_refused(residual):
    for bad in (np.nan, np.inf):
        r = residual.copy()
        r[2, 3] = bad
        with pytest.raises(errors.ShapeError, match="NaN or Inf"):
            decode_bundle(encode_bundle(r), n_cols=576)


def test_codegen_has_not_drifted():
    from meshnode.wire.codegen import drift

    assert drift() == []


def test_grpc_stubs_require_the_floor_pyproject_accepts_not_the_tools_patch():
    # grpc_tools stamps its own release as the least grpcio the stubs import with;
    # a new grpcio-tools patch must neither drift the check nor refuse an older grpcio
    import tomllib
    from pathlib import Path

    from meshnode.wire.codegen import GRPC_FLOOR, ROOT, stamp_floor

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    grpcio = next(d for d in deps if d.startswith("grpcio>="))
    floor = grpcio.removeprefix("grpcio>=").split(",")[0]
    assert GRPC_FLOOR.split(".")[:2] == floor.split(".")[:2]
    assert GRPC_FLOOR.endswith(".0")
    text = "x = 1\nGRPC_GENERATED_VERSION = '1.85.4'\nGRPC_VERSION = grpc.__version__\n"
    assert stamp_floor(text) == f"x = 1\nGRPC_GENERATED_VERSION = '{GRPC_FLOOR}'\nGRPC_VERSION = grpc.__version__\n"
    stub = Path(ROOT / "meshnode" / "proto" / "node_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'" in stub
