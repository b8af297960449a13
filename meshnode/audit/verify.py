"""``meshnode verify-evidence``: read, check and recompute one evidence file; the verdict and exit code.

Exit codes (what a tracker's verification subprocess is judged by):
0 the lie is confirmed, 1 the accusation is refuted (the hop computed what it sealed), 2 the evidence
is malformed (a typed error says what does not hold), 3 it cannot be verified here (another model,
llama.cpp failed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnode import errors
from meshnode.audit.evidence import check_evidence, open_evidence, read_evidence

CONFIRMED, REFUTED, MALFORMED, UNVERIFIABLE = 0, 1, 2, 3
VERDICTS = {CONFIRMED: "confirmed", REFUTED: "refuted", MALFORMED: "malformed", UNVERIFIABLE: "unverifiable"}


@dataclass
class Report:
    """What one verification found: ``exit`` is the process's exit code, ``doc`` the ``--json`` answer."""

    exit: int
    doc: dict[str, Any] = field(default_factory=dict)


def _error(exit: int, doc: dict[str, Any], e: errors.MeshnodeError) -> Report:
    return Report(exit, {**doc, "verdict": VERDICTS[exit], "error": e.code, "message": e.message})


def verify_file(path: Path, model: Path, fp: str | None = None) -> Report:
    """Verify the evidence in ``path`` with the GGUF ``model`` (``fp``: its fingerprint, if known)."""
    from meshnode.audit.recompute import as_json, check_model, recompute
    from meshnode.gguf.model import inspect_model

    doc: dict[str, Any] = {"file": str(path)}
    try:
        reporter, ev = open_evidence(read_evidence(path))
        doc.update(reporter=reporter, accused=ev.accused_node_id, model=ev.model_fingerprint,
                   range=[ev.range.start, ev.range.end], wrong_pos_start=ev.wrong_pos_start,
                   replica=ev.replica_node_id, reported_at_unix=ev.reported_at_unix)
        info = inspect_model(model)
        checked = check_evidence(ev, n_layer=info.n_layer, n_embd=info.n_embd)
        doc.update(session=checked.session_id, chunks=len(checked.chunks), positions=checked.positions)
        check_model(checked, model, fp)
    except errors.FingerprintMismatchError as e:
        return _error(UNVERIFIABLE, doc, e)
    except errors.ModelError as e:  # the model file itself (missing, not a GGUF)
        return _error(UNVERIFIABLE, doc, e)
    except errors.MeshnodeError as e:
        return _error(MALFORMED, doc, e)
    t0 = time.monotonic()
    try:
        verdict = recompute(checked, model, fp=fp)
    except (errors.ModelError, errors.ExecutorError) as e:
        return _error(UNVERIFIABLE, doc, e)
    except errors.MeshnodeError as e:  # llama.cpp's input checks: evidence no hop could have run
        return _error(MALFORMED, doc, e)
    doc.update(as_json(verdict), seconds=round(time.monotonic() - t0, 2))
    code = CONFIRMED if verdict.lied else REFUTED
    doc["verdict"] = VERDICTS[code]
    return Report(code, doc)


def render(r: Report) -> str:
    """The report in a few lines, for a terminal."""
    d = r.doc
    out = []
    if "accused" in d:
        out.append(f"reported by {d['reporter']}\naccused     {d['accused']} (layers {d['range'][0]}:{d['range'][1]} "
                   f"of model {d['model'][:16]}…)")
    if r.exit == CONFIRMED:
        out.append(f"lie confirmed: the chunk at position {d['pos_start']} ({d['n_tokens']} tokens) was sealed "
                   f"as {d['sealed_sha256'][:16]}…, it computes {d['computed_sha256'][:16]}… "
                   f"({d['chunks_checked']} of {d['chunks']} chunks recomputed)")
    elif r.exit == REFUTED:
        out.append(f"accusation refuted: all {d['chunks_checked']} chunks ({d['positions']} positions) compute "
                   "what the hop sealed")
    else:
        out.append(f"{d['verdict']}: {d['error']}: {d['message']}")
    return "\n".join(out)
