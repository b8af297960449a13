"""What ``meshnode model inspect FILE`` says of a GGUF: its shape and where it can be cut.

``describe`` reads the metadata only (no tensor data, vocabulary arrays
stepped over), so it answers in milliseconds for a file of any size;
``render`` turns the description into the text a user reads.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from meshnode.errors import CutRefusedError
from meshnode.gguf.arch import boundary_verdicts, meta_int, policy_for, swa_layers, window
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import inspect_model


def describe(path: Path) -> dict[str, Any]:
    """A JSON-able description of the model at ``path`` (typed errors for unusable files)."""
    info = inspect_model(path)
    meta = read_meta(path)
    arch, n_layer = info.arch, info.n_layer
    fields = meta.fields
    params = sum(math.prod(t.shape) for t in meta.tensors)
    expert_bytes = sum(t.n_bytes for t in meta.tensors if "_exps." in t.name)
    try:
        policy = policy_for(arch)
        support, why = "cut exactly", policy.note
    except CutRefusedError as e:
        policy, support, why = None, "runs whole only", e.message
    verdicts = boundary_verdicts(fields, arch, n_layer)
    try:
        flags = swa_layers(fields, arch, n_layer)
    except CutRefusedError:
        flags = None
    return {
        "file": str(path),
        "name": info.name,
        "architecture": arch,
        "layers": n_layer,
        "nextn_layers": meta_int(fields, f"{arch}.nextn_predict_layers"),
        "parameters": params,
        "size_bytes": info.size,
        "n_embd": info.n_embd,
        "n_vocab": info.n_vocab,
        "experts": meta_int(fields, f"{arch}.expert_count"),
        "experts_used": _most(fields, f"{arch}.expert_used_count"),
        "expert_bytes": expert_bytes,
        "context_train": info.n_ctx_train,
        "chat_template": "tokenizer.chat_template" in fields,
        "sliding_window": window(fields, arch) or None,
        "sliding_window_layers": sum(flags) if flags else 0,
        "support": support,
        "support_reason": why,
        "policy_source": policy.source if policy else None,
        "boundaries": [{"after_layer": k, "exact": verdicts.reason(k) is None, "reason": verdicts.reason(k)}
                       for k in range(1, n_layer)],
    }


def _most(fields: Any, key: str) -> int:
    """A per-layer (list) or model-wide integer: its largest value."""
    v = fields.get(key)
    if isinstance(v, list):
        return max((meta_int({key: x}, key) for x in v), default=0)
    return meta_int(fields, key)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def render(d: dict[str, Any]) -> str:
    """The description as lines of text; boundaries that share a verdict are folded into spans."""
    nextn = f" (+{d['nextn_layers']} next-token-prediction)" if d["nextn_layers"] else ""
    lines = [
        f"{d['name']}  ({d['file']})",
        f"  architecture    {d['architecture']}",
        f"  layers          {d['layers']}{nextn}",
        f"  parameters      {_count(d['parameters'])}",
        f"  size            {_size(d['size_bytes'])}",
        f"  embedding       {d['n_embd']}, vocabulary {d['n_vocab']}",
    ]
    if d["experts"]:
        share = d["expert_bytes"] / d["size_bytes"] if d["size_bytes"] else 0.0
        lines.append(f"  experts         {d['experts']} ({d['experts_used']} used per token; "
                     f"{share:.0%} of the file)")
    else:
        lines.append("  experts         none (dense)")
    lines.append(f"  context         {d['context_train'] or 'not stated'} (training)")
    lines.append(f"  chat template   {'yes' if d['chat_template'] else 'no'}")
    if d["sliding_window"]:
        lines.append(f"  sliding window  {d['sliding_window']} on {d['sliding_window_layers']} of {d['layers']} layers")
    lines.append(f"  cuts            {d['support']}" + (f" ({d['policy_source']})" if d["policy_source"] else ""))
    bounds = d["boundaries"]
    exact = [b["after_layer"] for b in bounds if b["exact"]]
    lines.append(f"  boundaries      {len(exact)} of {len(bounds)} exact")
    for first, last, reason in _spans(bounds):
        where = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"    at {where:<9} " + ("exact" if reason is None else f"refused: {reason}"))
    return "\n".join(lines)


def _spans(bounds: list[dict[str, Any]]) -> list[tuple[int, int, str | None]]:
    spans: list[tuple[int, int, str | None]] = []
    for b in bounds:
        k, reason = b["after_layer"], b["reason"]
        if spans and spans[-1][2] == reason and spans[-1][1] == k - 1:
            spans[-1] = (spans[-1][0], k, reason)
        else:
            spans.append((k, k, reason))
    return spans
