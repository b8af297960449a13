"""Which range should a joining node take? A pure function of the coverage.

``weakest_range`` slides a window of ``span`` layers over the model and
takes the one whose weakest layer has the fewest replicas (then the fewest
replicas in total, then the lowest start): a new node goes where the mesh is
thinnest, filling gaps first.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from meshnode.errors import InputError


def weakest_range(replicas: Sequence[int], span: int) -> tuple[int, int]:
    n = len(replicas)
    if not 0 < span <= n:
        raise InputError(f"a span of {span} layers does not fit a model of {n}")
    best = min(range(n - span + 1), key=lambda s: (min(replicas[s : s + span]), sum(replicas[s : s + span]), s))
    return best, best + span


def coverage(ranges: Sequence[tuple[str, int, int]], n_layer: int) -> list[list[str]]:
    """For each layer, the ids of the ``(id, start, end)`` ranges serving it. Pure."""
    layers: list[list[str]] = [[] for _ in range(n_layer)]
    for ident, a, b in ranges:
        for i in range(max(0, a), min(b, n_layer)):
            layers[i].append(ident)
    return layers


#: a quantization suffix of a GGUF file name: "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct"
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)
#: a fingerprint prefix must be this long to name a model
MIN_PREFIX = 8


def file_names(file_name: str) -> set[str]:
    """The names a GGUF file answers to, lower case: as is, without ``.gguf``, without its quant suffix. Pure."""
    f = file_name.strip().lower()
    if not f:
        return set()
    stem = f[: -len(".gguf")] if f.endswith(".gguf") else f
    return {f, stem, _QUANT_SUFFIX.sub("", stem)}


def is_short_prefix(query: str) -> bool:
    """A query that looks like a fingerprint prefix but is too short to name a model. Pure."""
    q = query.strip().lower()
    return 0 < len(q) < MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", q) is not None


def model_matches(fingerprint: str, name: str, query: str, file_name: str = "") -> bool:
    """A model named by its fingerprint (or a prefix of 8+ hex digits), its general.name or its file name.

    Case-insensitive. A file name matches with or without ``.gguf`` and its
    quant suffix, and a path matches by its last component (what ``model
    pull`` prints). Pure.
    """
    q = query.strip().lower()
    if not q:
        return False
    if len(q) >= MIN_PREFIX and re.fullmatch(r"[0-9a-f]+", q) and fingerprint.lower().startswith(q):
        return True
    base = q.rsplit("/", 1)[-1]
    return name.strip().lower() == q or (bool(base) and base in file_names(file_name))
