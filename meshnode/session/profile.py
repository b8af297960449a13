"""Where a decoded token's time goes, per hop, from the timings every step result carries.

Each hop stamps a step with ``compute_nanos`` (inside llama.cpp) and ``handle_nanos`` (from receiving
the step to having its result, the hops after it included). So for hop i of n:

* its **compute**: ``compute_i``;
* its **own handling**: ``handle_i - compute_i - handle_{i+1}`` (the tail: ``handle - compute``): the
  checks, digests and seal, the residual's encoding, and the link round trip to the next hop;
* and the **initiator's share**: wall time per token less the head's ``handle`` (results, credits and
  the wait between steps).

Pure: timings in, a table out (``meshnode generate --json`` prints it as ``hops``; docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class HopClock:
    """Sums over the decode steps of one hop."""

    endpoint: str
    compute_nanos: int = 0
    handle_nanos: int = 0
    steps: int = 0


@dataclass
class RouteClock:
    """Decode steps' timings, hop by hop in route order (a failover starts a new clock)."""

    hops: list[HopClock] = field(default_factory=list)
    tokens: int = 0

    def add(self, timings: Sequence[tuple[str, int, int]], tokens: int = 1) -> None:
        """One step's ``(endpoint, compute_nanos, handle_nanos)`` per hop, head first, that yielded
        ``tokens`` tokens. A step through other hops than the clock's restarts it (after a failover
        the old route's figures say nothing about the new one)."""
        if [h.endpoint for h in self.hops] != [t[0] for t in timings]:
            self.hops, self.tokens = [HopClock(t[0]) for t in timings], 0
        for h, (_, compute, handle) in zip(self.hops, timings, strict=True):
            h.compute_nanos += max(compute, 0)
            h.handle_nanos += max(handle, 0)
            h.steps += 1
        self.tokens += tokens

    def table(self, decode_seconds: float | None = None) -> dict[str, object]:
        """Per-token milliseconds of each hop (compute, handle, own), and the initiator's share when the
        decode's wall time is given."""
        n = max(self.tokens, 1)
        rows: list[dict[str, object]] = []
        for i, h in enumerate(self.hops):
            after = self.hops[i + 1].handle_nanos if i + 1 < len(self.hops) else 0
            rows.append({"endpoint": h.endpoint, "compute_ms": round(h.compute_nanos / n / 1e6, 3),
                         "handle_ms": round(h.handle_nanos / n / 1e6, 3),
                         "own_ms": round((h.handle_nanos - h.compute_nanos - after) / n / 1e6, 3)})
        out: dict[str, object] = {"tokens": self.tokens, "per_hop": rows}
        if decode_seconds and self.tokens and self.hops:
            wall = decode_seconds / self.tokens * 1e3
            out["wall_ms"] = round(wall, 3)
            out["initiator_ms"] = round(wall - self.hops[0].handle_nanos / n / 1e6, 3)
            out["compute_share"] = round(sum(h.compute_nanos for h in self.hops) / n / 1e6 / wall, 3)
        return out
