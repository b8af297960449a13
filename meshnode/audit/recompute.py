"""Recomputing an accused hop's range from checked evidence: a lie confirmed or refuted.

The accused's range is loaded from the verifier's own copy of the model (its fingerprint must be
the evidence's), with the numerics the accused sealed (n_batch, n_ubatch, flash attention: they
change the numbers; the context and thread counts do not, executor/context.py). Its chunks are fed
as the hop ran them: one ``llama_decode`` per chunk, in order, into one fresh KV sequence, since
what a chunk computes depends on the KV its predecessors left, and how that was chunked. Each
output is hashed as the hop hashed it (seals.py): the residual rows as their wire payload, or the
tail's float32 logits of the chunk's last row. The first digest that differs from the sealed one is
the lie; none differing refutes the accusation.

This runs llama.cpp's ``LlamaRange`` directly, the layer under ``RangeExecutor``: with one session
the executor hands each chunk to ``LlamaRange.forward_many`` alone, so the kernels and the batch
are the same, without a data-plane loop to run. A range not cut already is cut into a temporary
directory and removed after (a stranger's evidence chooses the range: nothing of it is kept).
Time and memory grow with the evidence's positions, which ``check_evidence`` bounds.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from meshnode import errors
from meshnode.audit.evidence import CheckedEvidence, Chunk
from meshnode.audit.seals import logits_digest, rows_digest
from meshnode.executor._llama import LlamaRange, StepOutput
from meshnode.executor.config import ExecConfig
from meshnode.executor.context import CTX_ALIGN
from meshnode.gguf.model import ModelInfo, fingerprint, inspect_model
from meshnode.gguf.slicer import RangeArtifact, cached_range, ensure_range, whole_model


@dataclass(frozen=True)
class Verdict:
    """What recomputing the accused's chunks found."""

    #: a sealed output differs from the recomputed one: the hop lied
    lied: bool
    #: chunks recomputed (through the first wrong one, or all of them)
    chunks_checked: int
    #: the first wrong chunk (None when refuted)
    pos_start: int | None = None
    n_tokens: int | None = None
    #: its sealed and recomputed output digests (hex)
    sealed_sha256: str = ""
    computed_sha256: str = ""
    #: the recomputed digest equals the one the reporter's replica found
    matches_reporter: bool = False


def exec_config(ev: CheckedEvidence) -> ExecConfig:
    """The accused's numerics as its seals state them, one session, a context that holds every position."""
    n = ev.numerics
    ctx = -(-ev.positions // CTX_ALIGN) * CTX_ALIGN
    if n.rope_ctx_orig and n.n_ctx_per_session > n.rope_ctx_orig:  # the accused's long rope factors
        ctx = max(ctx, n.rope_ctx_orig + CTX_ALIGN)
    elif n.rope_ctx_orig and ctx > n.rope_ctx_orig:  # its short ones (its positions fit its context)
        ctx = n.rope_ctx_orig
    return ExecConfig(n_ctx_per_session=ctx, rope_ctx_orig=n.rope_ctx_orig, n_batch=n.n_batch,
                      n_ubatch=n.n_ubatch, flash_attn=n.flash_attn, max_sessions=1, inline_decode=False)


def check_model(ev: CheckedEvidence, model: Path, fp: str | None = None) -> ModelInfo:
    """The model's metadata, once it is the evidence's model (FingerprintMismatchError) and the range and
    the residual's width fit it."""
    fp = fp or fingerprint(model)
    if fp != ev.fingerprint:
        raise errors.FingerprintMismatchError(f"{model} has fingerprint {fp[:12]}…; the evidence is about "
                                              f"{ev.fingerprint[:12]}…")
    info = inspect_model(model)
    if ev.end > info.n_layer:
        raise errors.LayerRangeError(f"the accused range {ev.start}:{ev.end} is outside the model's "
                                     f"{info.n_layer} layers")
    if ev.n_embd and ev.n_embd != info.n_embd:
        raise errors.ShapeError(f"the residual rows are {ev.n_embd} wide, the model's are {info.n_embd}")
    return info


@contextmanager
def _artifact(model: Path, ev: CheckedEvidence, info: ModelInfo) -> Iterator[RangeArtifact]:
    if (ev.start, ev.end) == (0, info.n_layer):
        yield whole_model(model)
        return
    cached = cached_range(model, ev.start, ev.end)
    if cached is not None:
        yield cached
        return
    with tempfile.TemporaryDirectory(prefix="meshnode-verify-") as tmp:
        yield ensure_range(model, ev.start, ev.end, root=Path(tmp))


def _digest(out: StepOutput, tail: bool, wire_dtype: int) -> bytes:
    if tail:
        if out.logits is None:
            raise errors.ExecutorError("the tail computed no logits")
        return logits_digest(out.logits)
    if out.residual is None:
        raise errors.ExecutorError("the range computed no residual")
    return rows_digest(out.residual, wire_dtype)


def _forward(rng: LlamaRange, c: Chunk) -> StepOutput:
    return rng.forward(0, c.pos_start, tokens=c.tokens, embd=c.rows)


def recompute(ev: CheckedEvidence, model: Path, *, fp: str | None = None) -> Verdict:
    """Run the accused's range on its inputs, chunk by chunk, against its seals. Blocking.

    Typed errors: FingerprintMismatchError (another model), LayerRangeError/ShapeError (evidence that
    does not fit this model), CutRefusedError (a range no hop can serve exactly), ExecutorError.
    """
    info = check_model(ev, model, fp)
    tail = ev.end == info.n_layer
    with _artifact(model, ev, info) as art:
        rng = LlamaRange(art, exec_config(ev))
        try:
            for i, c in enumerate(ev.chunks):
                got = _digest(_forward(rng, c), tail, ev.wire_dtype)
                if got != c.sealed_output:
                    return Verdict(True, i + 1, c.pos_start, c.n_tokens, c.sealed_output.hex(), got.hex(),
                                   got == ev.expected_output)
        finally:
            rng.close()
    return Verdict(False, len(ev.chunks))


def as_json(v: Verdict) -> dict[str, object]:
    return dataclasses.asdict(v)
