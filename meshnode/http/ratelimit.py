"""Token buckets per key (a source address, an initiator's node id), the table of keys bounded.

A key gets ``burst`` at once, then ``rate_per_second``; a key not seen for a
while has its burst back, never more. Keys beyond ``max_keys`` are forgotten
least recently seen first (a forgotten key comes back with a full bucket:
the table's memory is bounded whatever the number of keys). Pure: time comes
in as ``now``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

#: keys whose buckets are remembered (beyond, the least recently seen is forgotten: a full bucket)
MAX_KEYS = 65_536


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class RateTable:
    """A token bucket per key, the table bounded to ``MAX_KEYS``."""

    rate_per_second: float
    burst: float
    max_keys: int = MAX_KEYS
    buckets: collections.OrderedDict[str, _Bucket] = field(default_factory=collections.OrderedDict)

    def take(self, key: str, now: float) -> float:
        """Spend one token of ``key``'s bucket: 0.0 if there was one, else the seconds until there is."""
        b = self.buckets.pop(key, None)
        if b is None:
            b = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + max(0.0, now - b.at) * self.rate_per_second)
        b.at = now
        self.buckets[key] = b  # most recently seen last
        while len(self.buckets) > self.max_keys:
            self.buckets.popitem(last=False)
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        return (1.0 - b.tokens) / self.rate_per_second if self.rate_per_second > 0 else float("inf")


