"""What the cache limit removes (pure): ranges no running node serves, least recently used first.

Only entries a node could make again are evicted: range artifacts (cut again from their source) and
fetched models no node holds (fetched again from the mesh). Whole model files the user pulled or
placed are never evicted: ``model rm`` removes them when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    #: "file" (a whole model file), "fetched" (a model fetched in part), "range" (a cut range)
    kind: str
    path: str
    bytes: int
    last_used: float
    served: bool
    model_id: str = ""
    name: str = ""
    layers: str = ""


EVICTABLE = ("range", "fetched")


def over(entries: Sequence[Entry], limit: int) -> int:
    """Bytes the evictable entries hold beyond ``limit``."""
    return max(sum(e.bytes for e in entries if e.kind in EVICTABLE) - limit, 0)


def choose(entries: Sequence[Entry], limit: int) -> list[Entry]:
    """The entries to remove so that the evictable ones hold at most ``limit`` bytes: unserved ranges
    first, then unserved fetched models, each least recently used first. May not reach the limit
    when what is left is served."""
    excess = over(entries, limit)
    out: list[Entry] = []
    for kind in EVICTABLE:
        for e in sorted((e for e in entries if e.kind == kind and not e.served), key=lambda e: e.last_used):
            if excess <= 0:
                return out
            out.append(e)
            excess -= e.bytes
    return out
