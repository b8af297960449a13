"""Routes in use: what a head hop reports of the sessions it heads (``HealthReply.routes``). Pure.

A route session's head knows the whole route: itself, then every hop of its
SessionOpen's ``downstream``. Its Health answer (and so its tracker
heartbeats) carries each distinct route with the number of its sessions on
it, the busiest first and at most ``MAX_ROUTES_IN_USE``, so a tracker or a
gateway can draw the routes in use on its map (docs/tracker.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from meshnode.proto import node_pb2 as pb

#: distinct routes one HealthReply carries at most (the busiest)
MAX_ROUTES_IN_USE = 32
#: hops one reported route carries at most (a route longer than this is cut: its map path ends there)
MAX_HOPS_IN_USE = 64


def is_head(route_open: pb.RouteOpen) -> bool:
    """The hop the initiator feeds itself (the signed open names it as the previous party): a session's
    head; an audit session is no route in use."""
    return bool(route_open.initiator_node_id) and route_open.prev_node_id == route_open.initiator_node_id \
        and not route_open.audit


def routes_in_use(routes: Iterable[tuple[str, ...]]) -> list[pb.RouteInUse]:
    """One entry per distinct route (each a tuple of hop node ids, the head first), with its session count:
    the busiest first (then by hops, for a stable order), at most MAX_ROUTES_IN_USE, each cut to
    MAX_HOPS_IN_USE hops."""
    counts = Counter(tuple(r[:MAX_HOPS_IN_USE]) for r in routes if r)
    busiest = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_ROUTES_IN_USE]
    return [pb.RouteInUse(hops=list(hops), sessions=n) for hops, n in busiest]
