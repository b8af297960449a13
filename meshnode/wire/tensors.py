"""Tensor bundles: a residual on the wire, fragmented and CRC-32C checked.

The payload is the row-major little-endian bytes of a [n_tokens, n_embd]
array. float32 is the default and is bit-exact; float16 halves the bytes but
rounds the residual (SmolLM2's residual reaches ~2.5e4, where float16's step
is 16), so a float16 route is *not* bit-exact with the whole model.

``decode_bundle`` checks, in order: dtype, shape against what the step
expects, byte count, fragment tiling (sorted by offset, each fragment
non-empty and within max_chunk_bytes, no gap, no overlap, nothing past the
end), the CRC-32C, and finally that every value is finite. Each failure is
its own typed error (meshnode.errors).
"""

from __future__ import annotations

import google_crc32c
import numpy as np
import numpy.typing as npt

from meshnode.errors import ChecksumError, ShapeError, TilingError, WireError
from meshnode.proto import node_pb2 as pb

NP_DTYPES: dict[int, np.dtype[np.floating]] = {
    pb.DTYPE_F32: np.dtype("<f4"),
    pb.DTYPE_F16: np.dtype("<f2"),
}


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) — not zlib.crc32, which is a different polynomial."""
    return int(google_crc32c.value(bytes(data) if isinstance(data, memoryview) else data))


def encode_bundle(array: npt.NDArray[np.float32], *, dtype: int = pb.DTYPE_F32, pos_start: int = 0,
                  max_chunk_bytes: int = 1 << 20) -> pb.TensorBundle:
    """A bundle of ``array`` (2-D), converted to ``dtype``, in fragments of <= max_chunk_bytes."""
    if array.ndim != 2:
        raise ShapeError(f"a bundle carries a 2-D tensor, not {array.ndim}-D")
    np_dtype = NP_DTYPES.get(dtype)
    if np_dtype is None:  # e.g. a SessionOpen.wire_dtype outside DType: a typed error, not a KeyError
        raise ShapeError(f"dtype {dtype} is not a wire dtype (DTYPE_F32 or DTYPE_F16)")
    payload = np.ascontiguousarray(array, dtype=np_dtype).tobytes()
    bundle = pb.TensorBundle(
        dtype=dtype,  # type: ignore[arg-type]
        shape=list(array.shape),
        pos_start=pos_start,
        total_bytes=len(payload),
        checksum_algorithm=pb.CHECKSUM_CRC32C,
        checksum=crc32c(payload),
    )
    step = max(1, max_chunk_bytes)
    for off in range(0, len(payload), step):
        bundle.fragments.add(offset=off, data=payload[off : off + step])
    return bundle


def _assemble(bundle: pb.TensorBundle, max_chunk_bytes: int) -> bytes:
    frags = sorted(bundle.fragments, key=lambda f: f.offset)
    if len(frags) == 1 and frags[0].offset == 0:
        data = frags[0].data
        if len(data) > max_chunk_bytes:
            raise TilingError(f"fragment of {len(data)} bytes exceeds max_chunk_bytes {max_chunk_bytes}")
        if len(data) != bundle.total_bytes:
            raise TilingError(f"fragments cover {len(data)} of {bundle.total_bytes} bytes")
        return data
    expect = 0
    parts: list[bytes] = []
    for f in frags:
        if not f.data:
            raise TilingError(f"empty fragment at offset {f.offset}")
        if len(f.data) > max_chunk_bytes:
            raise TilingError(f"fragment of {len(f.data)} bytes exceeds max_chunk_bytes {max_chunk_bytes}")
        if f.offset != expect:
            kind = "gap" if f.offset > expect else "overlap"
            raise TilingError(f"fragment {kind} at byte {min(expect, f.offset)}")
        parts.append(f.data)
        expect += len(f.data)
    if expect != bundle.total_bytes:
        raise TilingError(f"fragments cover {expect} of {bundle.total_bytes} bytes")
    return b"".join(parts)


def decode_bundle(bundle: pb.TensorBundle, *, n_cols: int, n_rows: int | None = None,
                  max_chunk_bytes: int = 1 << 30, allowed: tuple[int, ...] = (pb.DTYPE_F32, pb.DTYPE_F16)
                  ) -> npt.NDArray[np.float32]:
    """Validate and reassemble a bundle into a float32 [n_rows, n_cols] array."""
    if bundle.dtype not in allowed:
        name = pb.DType.Name(bundle.dtype) if bundle.dtype in pb.DType.values() else str(bundle.dtype)
        raise ShapeError(f"dtype {name} is not accepted here")
    shape = tuple(bundle.shape)
    if len(shape) != 2 or shape[1] != n_cols or shape[0] < 1 or (n_rows is not None and shape[0] != n_rows):
        want = f"[{n_rows if n_rows is not None else 'n'}, {n_cols}]"
        raise ShapeError(f"tensor shape {list(shape)} does not fit this step (want {want})")
    np_dtype = NP_DTYPES[bundle.dtype]
    if bundle.total_bytes != shape[0] * shape[1] * np_dtype.itemsize:
        raise ShapeError(f"total_bytes {bundle.total_bytes} does not match shape {list(shape)} of {np_dtype}")
    if bundle.checksum_algorithm != pb.CHECKSUM_CRC32C:
        raise WireError("bundle has no CRC-32C checksum")
    payload = _assemble(bundle, max_chunk_bytes)
    if crc32c(payload) != bundle.checksum:
        raise ChecksumError(f"CRC-32C mismatch: payload {crc32c(payload):#010x}, declared {bundle.checksum:#010x}")
    array = np.frombuffer(payload, dtype=np_dtype).reshape(shape)
    if not np.isfinite(array).all():
        raise ShapeError("tensor contains NaN or Inf")
    return array.astype(np.float32, copy=bundle.dtype != pb.DTYPE_F32)
