"""Step seals: a hop's signed statement of what it was given and what it produced in one step.

The digests are over bytes both sides of a link see: token ids as int32 little-endian, residual
rows as the wire payload (float32 or float16, little-endian), and the tail's float32 logits of
the chunk's last row. The sender's output digest equals the receiver's input digest, so a hop can
disown neither what it received nor what it sent on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from meshnode import errors
from meshnode.identity.attest import open_signed, seal
from meshnode.identity.keys import NodeIdentity, node_id_of
from meshnode.proto import node_pb2 as pb
from meshnode.wire.tensors import NP_DTYPES

SEAL_TYPE = "meshnode.v1.StepSeal"


def tokens_digest(tokens: Sequence[int] | npt.NDArray[np.int32]) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).digest()


def rows_digest(rows: npt.NDArray[np.floating], wire_dtype: int) -> bytes:
    """Of residual rows as their wire payload (what ``encode_bundle`` sends for ``wire_dtype``)."""
    np_dtype = NP_DTYPES.get(wire_dtype or pb.DTYPE_F32)
    if np_dtype is None:
        raise errors.ShapeError(f"dtype {wire_dtype} is not a wire dtype (DTYPE_F32 or DTYPE_F16)")
    return hashlib.sha256(np.ascontiguousarray(rows, dtype=np_dtype).tobytes()).digest()


def logits_digest(logits: npt.NDArray[np.float32]) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(logits, dtype="<f4").tobytes()).digest()


def sign_step(ident: NodeIdentity, cap: pb.Capability, *, session_id: str, epoch: int, step_id: int,
              pos_start: int, n_tokens: int, wire_dtype: int, input_sha256: bytes, output_sha256: bytes,
              replayed: bool = False, token: int | None = None) -> pb.SignedEnvelope:
    s = pb.StepSeal(token=token, route_session_id=session_id, route_epoch=epoch, step_id=step_id,
                    hop_node_id=ident.node_id,
                    model_fingerprint=cap.model_fingerprint, range=cap.range, pos_start=pos_start,
                    n_tokens=n_tokens, wire_dtype=wire_dtype or pb.DTYPE_F32,  # type: ignore[arg-type]
                    numerics=cap.numerics, input_sha256=input_sha256, output_sha256=output_sha256,
                    replayed=replayed)
    return seal(ident, SEAL_TYPE, s.SerializeToString())


def open_seal(env: pb.SignedEnvelope, node_id: str | None = None) -> pb.StepSeal:
    """The seal, once its signature holds and it is signed by the node it names (and by ``node_id``
    when given); ``SignatureError`` otherwise."""
    s = open_signed(env, SEAL_TYPE, pb.StepSeal)
    signer = node_id_of(env.signer_public_key)
    if s.hop_node_id != signer:
        raise errors.SignatureError(f"a step seal naming {s.hop_node_id[:12]}… is signed by {signer[:12]}…")
    if node_id is not None and signer != node_id:
        raise errors.SignatureError(f"the step seal is signed by {signer[:12]}…, not {node_id[:12]}…")
    return s
