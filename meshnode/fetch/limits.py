"""How much of a node's bandwidth peers' fetches may take (pure: time comes in as ``now``).

A node that serves a model's bytes to a joining peer keeps serving its own sessions: fetches are
paced to ``rate`` bytes a second in all (a byte bucket with a ``burst``), at most ``per_requester``
of them run at once for one requester (a peer address) and ``total`` in all. A fetch over those is
refused at once with a typed error naming the limit; the fetcher tries another peer or waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnode import errors

#: default pace of the bytes a node serves to fetching peers: 64 MiB/s (a 1 GbE link's half)
DEFAULT_RATE = 64 << 20


@dataclass(frozen=True)
class ShareLimits:
    #: bytes a second served in all (0: unpaced)
    rate: int = DEFAULT_RATE
    #: bytes that may go at once before the pace applies
    burst: int = 8 << 20
    #: concurrent fetches of one requester
    per_requester: int = 2
    #: concurrent fetches in all
    total: int = 4


@dataclass
class Pacer:
    """A byte bucket: ``delay(n, now)`` is how long to wait before sending ``n`` bytes (spent at once)."""

    rate: float
    burst: float
    tokens: float = -1.0
    at: float = 0.0

    def delay(self, n: int, now: float) -> float:
        if self.rate <= 0:
            return 0.0
        if self.tokens < 0 and self.at == 0.0:
            self.tokens, self.at = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


@dataclass
class Admission:
    """Concurrent fetches by requester, bounded per requester and in all."""

    limits: ShareLimits
    active: dict[str, int] = field(default_factory=dict)

    def enter(self, requester: str) -> None:
        if sum(self.active.values()) >= self.limits.total:
            raise errors.FetchBusyError(f"this node serves {self.limits.total} fetches already: another peer, or later")
        if self.active.get(requester, 0) >= self.limits.per_requester:
            raise errors.FetchBusyError(f"{requester} has {self.limits.per_requester} fetches running here already")
        self.active[requester] = self.active.get(requester, 0) + 1

    def leave(self, requester: str) -> None:
        n = self.active.get(requester, 0) - 1
        if n > 0:
            self.active[requester] = n
        else:
            self.active.pop(requester, None)
