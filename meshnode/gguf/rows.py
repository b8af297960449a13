"""Dequantizing a few rows of a GGUF tensor: the head's token-embedding lookup.

``gguf.quants.dequantize`` is exact and general, but per call it costs tens of
µs of set-up beside the arithmetic: a head looks up one row a token, on the
token's critical path. Q8_0 (the token table of the default models and of
``bench.synth``'s) and the float types get a direct numpy path here; every
other type goes to the gguf package.

The direct paths compute what ggml's ``dequantize_row_q8_0`` computes, one
float32 product per value (``qs[j] * d`` with ``d`` the block's fp16 scale
widened to float32), so they are bit-identical to it and to the gguf
package's (tests/test_rows.py checks them against the package on random
blocks, fp16 subnormals and infinities included).
"""

from __future__ import annotations

import gguf
import numpy as np
import numpy.typing as npt

Q8_0_BLOCK = 32
Q8_0_BYTES = 2 + Q8_0_BLOCK  # an fp16 scale, then 32 int8 quants


def dequantize_rows(rows: npt.NDArray[np.uint8], qtype: gguf.GGMLQuantizationType) -> npt.NDArray[np.float32]:
    """``rows`` (n, row_bytes) of raw tensor bytes of type ``qtype`` -> (n, n_values) float32."""
    n = rows.shape[0]
    if qtype == gguf.GGMLQuantizationType.Q8_0 and rows.shape[1] % Q8_0_BYTES == 0:
        blocks = np.ascontiguousarray(rows).reshape(-1, Q8_0_BYTES)
        scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
        quants = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (quants * scale).reshape(n, -1)
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(rows).view(np.float32).reshape(n, -1).copy()
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(rows).view(np.float16).reshape(n, -1).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(n, -1)
