"""Choosing a route: a pure function from candidate peers to the fastest chain.

Each candidate serves one fixed range [start, end). A route is a chain of
candidates whose ranges tile [0, n_layer) exactly. Its estimated time per
token is the sum over hops of the hop's advertised compute time for one
token (1 / decode throughput) times the number of sessions that would share
it (those it reports live, those this chooser already placed on it, and this
one), its measured round-trip time, and a small per-session penalty — so
concurrent sessions spread across replicas. Candidates without a free session slot
are skipped. Shortest path over layer boundaries (Dijkstra); ties break on
the node ids, so the choice is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshnode.errors import RouteError


@dataclass(frozen=True)
class Candidate:
    node_id: str
    endpoint: str
    start: int
    end: int
    #: advertised single-session decode tokens/s of this range (0 = unknown)
    decode_tps: float
    #: measured round trip to it, seconds
    rtt: float
    #: free session slots it reports
    free_sessions: int
    #: sessions it reports live now (other initiators' load)
    live_sessions: int = 0


#: seconds added per session already placed on a node by this chooser
LOAD_PENALTY = 0.010
#: assumed compute time per token when a node advertises no throughput
UNKNOWN_COMPUTE = 0.050


def hop_cost(c: Candidate, load: int) -> float:
    """Estimated seconds per token on this hop: sessions sharing it share its compute."""
    compute = 1.0 / c.decode_tps if c.decode_tps > 0 else UNKNOWN_COMPUTE
    sharing = load + c.live_sessions
    return compute * (1 + sharing) + c.rtt + LOAD_PENALTY * sharing


def choose_route(candidates: Sequence[Candidate], n_layer: int, *, load: Mapping[str, int] | None = None,
                 avoid: frozenset[str] = frozenset(), start: int = 0) -> list[Candidate]:
    """The chain covering [start, n_layer) with the lowest estimated time per token.

    ``start`` > 0 asks for the chain of one span [start, n_layer) only: a failover re-routes
    the span of a dead hop and keeps the rest of the route.
    """
    load = load or {}
    usable = [c for c in candidates
              if c.free_sessions > 0 and c.node_id not in avoid and start <= c.start < c.end]
    by_start: dict[int, list[Candidate]] = {}
    for c in usable:
        by_start.setdefault(c.start, []).append(c)
    # (cost, tie-break path of node ids, boundary, path)
    heap: list[tuple[float, tuple[str, ...], int, tuple[Candidate, ...]]] = [(0.0, (), start, ())]
    done: set[int] = set()
    while heap:
        cost, ids, at, path = heapq.heappop(heap)
        if at == n_layer:
            return list(path)
        if at in done:
            continue
        done.add(at)
        for c in by_start.get(at, []):
            if c.end <= n_layer and c.end not in done:
                heapq.heappush(heap, (cost + hop_cost(c, load.get(c.node_id, 0)), (*ids, c.node_id), c.end,
                                      (*path, c)))
    raise RouteError(gap_message(usable, n_layer, reached=done, start=start))


def gap_message(usable: Sequence[Candidate], n_layer: int, reached: set[int], start: int = 0) -> str:
    """Name the first layers no reachable chain serves, e.g. 'layers 12-17 are not served ...'."""
    if not usable:
        return f"no reachable node serves this model (layers {start}-{n_layer - 1} are not served)"
    frontier = max(reached) if reached else start
    later = [c.start for c in usable if c.start > frontier]
    last = (min(later) - 1) if later else n_layer - 1
    return f"layers {frontier}-{last} are not served by any reachable node"
