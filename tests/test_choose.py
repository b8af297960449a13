"""Route choice: a pure function, tested on ties, gaps, replicas and load."""

from __future__ import annotations

import pytest

from meshnode.errors import RouteError
from meshnode.routing.choose import Candidate, choose_route


def c(node: str, a: int, b: int, tps: float = 100.0, rtt: float = 0.001, free: int = 4) -> Candidate:
    return Candidate(node, f"{node}:1", a, b, tps, rtt, free)


def ids(route):
    return [x.node_id for x in route]


def test_a_single_chain_is_found():
    assert ids(choose_route([c("b", 15, 30), c("a", 0, 15)], 30)) == ["a", "b"]


def test_the_faster_replica_wins():
    route = choose_route([c("a", 0, 15), c("slow", 15, 30, tps=20), c("fast", 15, 30, tps=200)], 30)
    assert ids(route) == ["a", "fast"]


def test_lower_rtt_breaks_equal_throughput():
    route = choose_route([c("a", 0, 15), c("far", 15, 30, rtt=0.05), c("near", 15, 30, rtt=0.001)], 30)
    assert ids(route) == ["a", "near"]


def test_fewer_hops_win_when_each_hop_costs():
    cands = [c("whole", 0, 30, tps=60), c("h", 0, 15, tps=200), c("t", 15, 30, tps=200)]
    # 1/60 + 1 ms = 17.7 ms vs 2 x (5 ms + 1 ms) = 12 ms: the two-hop route is faster
    assert ids(choose_route(cands, 30)) == ["h", "t"]
    # ... until the hops are far away: 2 x (5 + 10) ms = 30 ms
    slow = [c("whole", 0, 30, tps=60), c("h", 0, 15, tps=200, rtt=0.01), c("t", 15, 30, tps=200, rtt=0.01)]
    assert ids(choose_route(slow, 30)) == ["whole"]


def test_exact_ties_break_deterministically_on_node_id():
    cands = [c("z", 15, 30), c("a", 0, 15), c("m", 15, 30)]
    assert ids(choose_route(cands, 30)) == ["a", "m"]
    assert ids(choose_route(list(reversed(cands)), 30)) == ["a", "m"]


def test_gaps_are_named():
    with pytest.raises(RouteError, match="layers 12-17 are not served by any reachable node"):
        choose_route([c("a", 0, 12), c("b", 18, 30)], 30)
    with pytest.raises(RouteError, match="layers 0-29"):
        choose_route([], 30)
    with pytest.raises(RouteError, match="layers 20-29"):
        choose_route([c("a", 0, 20)], 30)


def test_full_nodes_and_avoided_nodes_are_skipped():
    cands = [c("a", 0, 15), c("full", 15, 30, tps=500, free=0), c("ok", 15, 30)]
    assert ids(choose_route(cands, 30)) == ["a", "ok"]
    with pytest.raises(RouteError, match="layers 15-29"):
        choose_route(cands, 30, avoid=frozenset({"ok"}))


def test_a_busy_replica_is_avoided():
    cands = [c("a", 0, 15), Candidate("busy", "busy:1", 15, 30, 100.0, 0.001, 1, live_sessions=3), c("idle", 15, 30)]
    assert ids(choose_route(cands, 30)) == ["a", "idle"]


def test_load_spreads_sessions_across_replicas():
    cands = [c("a", 0, 15), c("r1", 15, 30), c("r2", 15, 30)]
    load: dict[str, int] = {}
    picks = []
    for _ in range(4):
        route = choose_route(cands, 30, load=load)
        for x in route:
            load[x.node_id] = load.get(x.node_id, 0) + 1
        picks.append(route[-1].node_id)
    assert sorted(picks) == ["r1", "r1", "r2", "r2"]
