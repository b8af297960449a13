"""Check that a list of peers, in the order given, forms one exact route.

Pure: takes the peers' capabilities, returns nothing or raises RouteError
naming the first problem (another model, a gap, an overlap, a range that does
not start at 0 or end at n_layer, unequal numerics settings).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerView:
    """What the route check needs to know of one peer."""

    endpoint: str
    fingerprint: str
    n_layer: int
    start: int
    end: int
    numerics: tuple[tuple[str, int | bool], ...]


def check_chain(peers: Sequence[PeerView]) -> None:
    from meshnode.errors import RouteError

    if not peers:
        raise RouteError("a route needs at least one --peer")
    first = peers[0]
    for p in peers[1:]:
        if p.fingerprint != first.fingerprint:
            raise RouteError(
                f"{p.endpoint} serves model {p.fingerprint[:12]}…, but {first.endpoint} "
                f"serves {first.fingerprint[:12]}…: a route runs one model"
            )
        if p.numerics != first.numerics:
            raise RouteError(
                f"{p.endpoint} runs numerics {dict(p.numerics)} but {first.endpoint} runs "
                f"{dict(first.numerics)}: the route would not equal the whole model"
            )
    if first.start != 0:
        raise RouteError(
            f"layers 0-{first.start - 1} are not served: the first peer {first.endpoint} starts at {first.start}"
        )
    for prev, nxt in itertools.pairwise(peers):
        if nxt.start > prev.end:
            raise RouteError(
                f"layers {prev.end}-{nxt.start - 1} are not served between {prev.endpoint} "
                f"({prev.start}:{prev.end}) and {nxt.endpoint} ({nxt.start}:{nxt.end})"
            )
        if nxt.start < prev.end:
            raise RouteError(
                f"{prev.endpoint} ({prev.start}:{prev.end}) and {nxt.endpoint} "
                f"({nxt.start}:{nxt.end}) overlap; give peers in layer order, each range once"
            )
    last = peers[-1]
    if last.end != first.n_layer:
        raise RouteError(
            f"layers {last.end}-{first.n_layer - 1} are not served: the last peer {last.endpoint} ends at {last.end}"
        )
