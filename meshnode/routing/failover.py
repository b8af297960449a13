"""Failover decisions: pure functions of what the initiator knows.

When a hop fails mid-generation the initiator re-routes that hop's span only
(``replacement``): the other hops keep their KV state. A peer that failed is
avoided for a while (``Backoff``: exponential, capped), so a flapping peer is
not chosen again at once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from meshnode import errors
from meshnode.routing.choose import Candidate, choose_route

#: error codes after which the same request may succeed on another peer
FAILOVER_CODES = frozenset({"PEER_UNAVAILABLE", "DEADLINE_EXCEEDED", "EXECUTOR_FAILED", "CACHE_MISS",
                            "RESOURCE_EXHAUSTED"})


@dataclass
class Backoff:
    """Peers to avoid after failures: the k-th failure in a row bars a peer for base * 2^(k-1) s (capped)."""

    base: float = 2.0
    cap: float = 60.0
    _failures: dict[str, tuple[int, float]] = field(default_factory=dict)

    def fail(self, endpoint: str, now: float) -> float:
        """Record a failure; returns the time until which the peer is avoided."""
        k = self._failures.get(endpoint, (0, 0.0))[0] + 1
        until = now + min(self.cap, self.base * 2.0 ** (k - 1))
        self._failures[endpoint] = (k, until)
        return until

    def succeed(self, endpoint: str) -> None:
        self._failures.pop(endpoint, None)

    def avoided(self, now: float) -> frozenset[str]:
        return frozenset(e for e, (_, until) in self._failures.items() if until > now)


def can_fail_over(e: errors.MeshnodeError, route: Sequence[str]) -> bool:
    """A hop of this route failed in a way another peer of its range may not."""
    return e.code in FAILOVER_CODES and e.hop in route


def spare_candidates(known: Iterable[Candidate], route: Collection[str]) -> list[Candidate]:
    """The peers that may take over a span: every known peer of the model that is not on the route now.

    A peer that failed stays known (it may be restarted); ``Backoff`` keeps it out for a while.
    """
    return sorted((c for c in known if c.endpoint not in route), key=lambda c: c.endpoint)


def replacement(span: tuple[int, int], spares: Sequence[Candidate], avoid: frozenset[str]) -> list[Candidate]:
    """The chain of spares that serves exactly the layers [a, b) of a failed hop.

    Raises RouteError naming the layers no usable spare serves.
    """
    a, b = span
    usable = [c for c in spares if c.endpoint not in avoid and a <= c.start and c.end <= b]
    try:
        return choose_route(usable, b, start=a)
    except errors.RouteError as e:
        raise errors.RouteError(f"no other peer can take over layers {a}:{b}: {e.message}") from None


def replay_depths(chunks: Sequence[int], cached: Sequence[int]) -> list[int]:
    """For each chunk of a session's history (lengths, in order): how many hops from the head a replay
    of it must reach, i.e. 1 + the index of the last hop that lacks its positions (0: no hop does,
    skip it). ``cached[j]``: the positions hop j holds after the resume."""
    out, pos = [], 0
    for n in chunks:
        lacking = [j for j, held in enumerate(cached) if held < pos + n]
        out.append(lacking[-1] + 1 if lacking else 0)
        pos += n
    return out
