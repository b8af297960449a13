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
