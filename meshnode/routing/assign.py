"""Which range should a joining node take? A pure function of the coverage.

``weakest_range`` slides a window of ``span`` layers over the model and
takes the one whose weakest layer has the fewest replicas (then the fewest
replicas in total, then the lowest start): a new node goes where the mesh is
thinnest, filling gaps first.
"""

from __future__ import annotations

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


def model_matches(fingerprint: str, name: str, query: str) -> bool:
    """A model named by its fingerprint (or a prefix of 8+ hex digits) or its general.name. Pure."""
    q = query.strip().lower()
    return (len(q) >= 8 and fingerprint.startswith(q)) or name.lower() == q
