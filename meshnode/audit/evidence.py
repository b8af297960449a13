"""Evidence that a hop lied: signing, reading, and the structural checks anyone can run.

An ``Evidence`` holds every chunk the accused hop ran in one session, from position 0 in the
original chunking through the chunk whose sealed output the reporter found wrong: the hop's own
step seals, and the inputs it was given (token ids for a head; else the residual payload with the
previous hop's seal over it). ``check_evidence`` proves, without the model, that the accused signed
each seal, that the inputs are the ones it signed for (and, past the head, the ones the previous
hop signed as sent), and that the chunks are contiguous; what is left to decide is whether the
accused's outputs are what its range computes from those inputs: ``meshnode.audit.recompute``.

Pure and bounded: the envelope is at most ``MAX_EVIDENCE_BYTES``, the chunks and positions at most
``MAX_STEPS`` and ``MAX_POSITIONS``, so a hostile file cannot make the checks (or a recomputation
after them) take unbounded memory or time. Imports no llama.cpp: the tracker runs these checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from meshnode import atomicfile, errors
from meshnode.audit.seals import open_seal, rows_digest, tokens_digest
from meshnode.identity.attest import open_signed, seal
from meshnode.identity.keys import NodeIdentity, node_id_of
from meshnode.proto import node_pb2 as pb
from meshnode.wire.tensors import decode_bundle

EVIDENCE_TYPE = "meshnode.v1.Evidence"
#: bytes a serialized evidence envelope may take (a file, a tracker's POST body): 64 MiB holds ~29k
#: positions of SmolLM2's float32 residual (2.3 KB a row), the same bound as one gRPC message
MAX_EVIDENCE_BYTES = 64 * 1024 * 1024
#: chunks one evidence may hold
MAX_STEPS = 65_536
#: positions one evidence may cover: bounds the KV cache and the time a recomputation takes
MAX_POSITIONS = 65_536
#: tokens one chunk may hold (llama.cpp's n_batch as a hop may set it)
MAX_CHUNK = 8192
#: layers a model may have (a claimed range past it is refused before anything is decoded)
MAX_LAYERS = 1024
_SHA256 = 32


@dataclass(frozen=True)
class Chunk:
    """One checked chunk of the accused's session: its input and what the accused sealed as output."""

    pos_start: int
    n_tokens: int
    #: head: the token ids; else None
    tokens: npt.NDArray[np.int32] | None
    #: not a head: the residual rows received, float32 [n_tokens, n_embd]; else None
    rows: npt.NDArray[np.float32] | None
    #: the output digest the accused signed for this chunk
    sealed_output: bytes


@dataclass(frozen=True)
class CheckedEvidence:
    """Evidence whose seals, inputs and chunking hold: what a recomputation needs."""

    accused: str
    fingerprint: str
    start: int
    end: int
    session_id: str
    #: the accused's numerics, as its seals state them (one value for the whole session)
    numerics: pb.Numerics
    wire_dtype: int
    #: width of the residual rows (0 for a head: its inputs are token ids)
    n_embd: int
    chunks: tuple[Chunk, ...]
    #: what the reporter's replica computed for the last chunk
    expected_output: bytes

    @property
    def positions(self) -> int:
        last = self.chunks[-1]
        return last.pos_start + last.n_tokens


# -- envelopes and files ---------------------------------------------------------------------


def sign_evidence(ident: NodeIdentity, ev: pb.Evidence) -> pb.SignedEnvelope:
    """The reporter's signed envelope of ``ev`` (what a tracker's ``POST /api/evidence`` takes)."""
    return seal(ident, EVIDENCE_TYPE, ev.SerializeToString())


def open_evidence(env: pb.SignedEnvelope) -> tuple[str, pb.Evidence]:
    """(the reporter's node id, the evidence) once the envelope's signature holds; SignatureError else.
    Says nothing about the evidence itself: ``check_evidence`` does."""
    return node_id_of(env.signer_public_key), open_signed(env, EVIDENCE_TYPE, pb.Evidence)


def parse_envelope(data: bytes) -> pb.SignedEnvelope:
    """A serialized SignedEnvelope of at most MAX_EVIDENCE_BYTES; InputError for more or for garbage."""
    if len(data) > MAX_EVIDENCE_BYTES:
        raise errors.InputError(f"evidence of {len(data)} bytes is over the {MAX_EVIDENCE_BYTES}-byte bound")
    try:
        return pb.SignedEnvelope.FromString(data)
    except DecodeError as e:
        raise errors.InputError(f"not a serialized SignedEnvelope: {e}") from None


def write_evidence(path: Path | str, env: pb.SignedEnvelope) -> None:
    """``env`` serialized to ``path``, whole or not at all (read back by ``read_evidence``)."""
    data = env.SerializeToString()
    if len(data) > MAX_EVIDENCE_BYTES:
        raise errors.InputError(f"evidence of {len(data)} bytes is over the {MAX_EVIDENCE_BYTES}-byte bound")
    atomicfile.write(Path(path), data, 0o644)


def read_evidence(path: Path | str) -> pb.SignedEnvelope:
    """The envelope in ``path``: InputError if it is missing, over the bound, or not an envelope."""
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size > MAX_EVIDENCE_BYTES:
                raise errors.InputError(f"{path} is over the {MAX_EVIDENCE_BYTES}-byte bound of evidence")
            data = fh.read(MAX_EVIDENCE_BYTES + 1)
    except OSError as e:
        raise errors.InputError(f"cannot read evidence {path}: {e.strerror or e}") from None
    return parse_envelope(data)


# -- the checks --------------------------------------------------------------------------------


def _hx(b: bytes) -> str:
    return b.hex()[:16] + "…"


def _check_head(ev: pb.Evidence, n_layer: int | None) -> None:
    r = ev.range
    if not ev.accused_node_id:
        raise errors.InputError("the evidence names no accused node")
    if len(ev.model_fingerprint) != 64:
        raise errors.InputError("the evidence's model fingerprint is not a sha256")
    limit = MAX_LAYERS if n_layer is None else n_layer
    if not r.start < r.end <= limit:
        raise errors.LayerRangeError(f"the accused range {r.start}:{r.end} is not within [0, {limit})")
    if not 1 <= len(ev.steps) <= MAX_STEPS:
        raise errors.InputError(f"the evidence holds {len(ev.steps)} chunks; allowed 1..{MAX_STEPS}")
    if len(ev.expected_output_sha256) != _SHA256:
        raise errors.InputError("the evidence's expected output is not a sha256 digest")


def _check_seal(ev: pb.Evidence, s: pb.StepSeal, first: pb.StepSeal | None, pos: int) -> None:
    """One accused seal against the evidence and the session's first seal."""
    if s.model_fingerprint != ev.model_fingerprint:
        raise errors.FingerprintMismatchError(f"the seal at position {s.pos_start} is for model "
                                              f"{s.model_fingerprint[:12]}…, the evidence for "
                                              f"{ev.model_fingerprint[:12]}…")
    if (s.range.start, s.range.end) != (ev.range.start, ev.range.end):
        raise errors.RangeMismatchError(f"the seal at position {s.pos_start} is for layers {s.range.start}:"
                                        f"{s.range.end}, the evidence for {ev.range.start}:{ev.range.end}")
    if first is not None and s.route_session_id != first.route_session_id:
        raise errors.SessionError(f"the seal at position {s.pos_start} is of session {s.route_session_id!r}, "
                                  f"the first of {first.route_session_id!r}")
    if first is not None and (s.numerics != first.numerics or s.wire_dtype != first.wire_dtype):
        raise errors.SessionError(f"the seal at position {s.pos_start} states other numerics or wire dtype "
                                  "than the first: one session has one of each")
    if s.pos_start != pos:
        raise errors.InputError(f"chunks are not contiguous from position 0: expected one at {pos}, "
                                f"got one at {s.pos_start}")
    if s.wire_dtype not in (pb.DTYPE_F32, pb.DTYPE_F16):
        raise errors.ShapeError(f"the seal at position {s.pos_start} names wire dtype {s.wire_dtype}, not f32 or f16")
    n = s.numerics
    if not 1 <= s.n_tokens <= min(n.n_batch, MAX_CHUNK) or not 1 <= n.n_ubatch <= n.n_batch:
        raise errors.InputError(f"the chunk at position {s.pos_start} has {s.n_tokens} tokens with n_batch "
                                f"{n.n_batch}, n_ubatch {n.n_ubatch}: no hop runs that")
    if pos + s.n_tokens > MAX_POSITIONS:
        raise errors.InputError(f"the evidence covers more than {MAX_POSITIONS} positions")
    if len(s.input_sha256) != _SHA256 or len(s.output_sha256) != _SHA256:
        raise errors.InputError(f"the seal at position {s.pos_start} carries digests that are not sha256")


def _check_sender(step: pb.EvidenceStep, s: pb.StepSeal) -> None:
    """The previous hop's seal: it sent exactly what the accused signed as received."""
    if not step.HasField("sender_seal"):
        raise errors.InputError(f"the chunk at position {s.pos_start} comes without the sender's seal")
    prev = open_seal(step.sender_seal)  # signed by whoever it names
    if (prev.route_session_id, prev.pos_start, prev.n_tokens) != (s.route_session_id, s.pos_start, s.n_tokens):
        raise errors.SessionError(f"the sender's seal is for session {prev.route_session_id!r} chunk "
                                  f"{prev.pos_start}+{prev.n_tokens}, not {s.route_session_id!r} "
                                  f"{s.pos_start}+{s.n_tokens}")
    if prev.model_fingerprint != s.model_fingerprint:
        raise errors.FingerprintMismatchError(f"the sender's seal at position {s.pos_start} is for another model")
    if prev.range.end != s.range.start:
        raise errors.RangeMismatchError(f"the sender's seal at position {s.pos_start} is for layers "
                                        f"{prev.range.start}:{prev.range.end}, which do not end where the "
                                        f"accused's ({s.range.start}) start")
    if prev.output_sha256 != s.input_sha256:
        raise errors.ChecksumError(f"at position {s.pos_start} the sender sealed output {_hx(prev.output_sha256)}, "
                                   f"the accused sealed input {_hx(s.input_sha256)}")


def _input(step: pb.EvidenceStep, s: pb.StepSeal, head: bool, n_embd: int | None) -> Chunk:
    """The chunk's input, checked against the accused's input digest (and the sender's output digest)."""
    if head:
        tokens = np.asarray(step.tokens, dtype=np.int32)
        if len(tokens) != s.n_tokens:
            raise errors.ShapeError(f"the chunk at position {s.pos_start} carries {len(tokens)} token ids, "
                                    f"its seal says {s.n_tokens}")
        if tokens_digest(tokens) != s.input_sha256:
            raise errors.ChecksumError(f"the token ids at position {s.pos_start} are not the ones the accused "
                                       "sealed as its input")
        return Chunk(s.pos_start, s.n_tokens, tokens, None, s.output_sha256)
    act = step.activation
    if not step.HasField("activation") or len(act.shape) != 2:
        raise errors.ShapeError(f"the chunk at position {s.pos_start} carries no residual rows")
    if act.dtype != s.wire_dtype:
        raise errors.ShapeError(f"the residual at position {s.pos_start} is of dtype {act.dtype}, the seal says "
                                f"{s.wire_dtype}")
    if act.pos_start != s.pos_start:
        raise errors.ShapeError(f"the residual of the chunk at {s.pos_start} says position {act.pos_start}")
    rows = decode_bundle(act, n_cols=n_embd if n_embd is not None else act.shape[1], n_rows=s.n_tokens)
    if rows_digest(rows, s.wire_dtype) != s.input_sha256:
        raise errors.ChecksumError(f"the residual at position {s.pos_start} is not the one the accused sealed "
                                   "as its input")
    _check_sender(step, s)
    return Chunk(s.pos_start, s.n_tokens, None, rows, s.output_sha256)


def check_evidence(ev: pb.Evidence, *, n_layer: int | None = None, n_embd: int | None = None) -> CheckedEvidence:
    """``ev``'s chunks, once every structural check holds; the typed error of the first that fails.

    Checked: every seal opens and is signed by the accused (SignatureError); names the evidence's
    model (FingerprintMismatchError) and range (RangeMismatchError), one session, one numerics and wire
    dtype (SessionError); chunks run contiguously from position 0, the last one at ``wrong_pos_start``,
    within the bounds (InputError); each input hashes to the accused's input digest, and past the head
    the sender's seal opens, is for the same session and chunk, ends where the accused's range starts
    and sealed that same digest as its output (ChecksumError, ShapeError, the wire's errors).
    ``n_layer``/``n_embd``: the model's, when known (a verifier holding it), else from the evidence.
    """
    _check_head(ev, n_layer)
    head = ev.range.start == 0
    chunks: list[Chunk] = []
    first: pb.StepSeal | None = None
    pos = 0
    for step in ev.steps:
        s = open_seal(step.seal, ev.accused_node_id)
        _check_seal(ev, s, first, pos)
        first = first or s
        chunk = _input(step, s, head, n_embd)
        if chunk.rows is not None:
            n_embd = chunk.rows.shape[1]  # every later chunk must have the width of the first
        chunks.append(chunk)
        pos += s.n_tokens
    assert first is not None
    last = chunks[-1]
    if last.pos_start != ev.wrong_pos_start:
        raise errors.InputError(f"the evidence accuses the chunk at position {ev.wrong_pos_start} but ends with "
                                f"the one at {last.pos_start}")
    if last.sealed_output == ev.expected_output_sha256:
        raise errors.InputError("the reporter's expected output equals the sealed one: nothing is accused")
    return CheckedEvidence(ev.accused_node_id, ev.model_fingerprint, ev.range.start, ev.range.end,
                           first.route_session_id, first.numerics, first.wire_dtype or pb.DTYPE_F32,
                           0 if head else int(n_embd or 0), tuple(chunks), ev.expected_output_sha256)
