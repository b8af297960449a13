"""Whom a node takes in and whom it lets go: its session-hosting decisions, as pure functions of state.

The host (session/host.py) holds the state — live sessions, detached
ones with the time each was detached, a token bucket per initiator — and
acts on what these functions decide:

* ``open_rate``: may this initiator open one more session now (opens per
  initiator per minute, a burst then a rate)? A signed open names its
  initiator, checked before this is asked: nobody spends another's budget.
* ``room``: no free KV slot for an open: the detached session to evict (the
  oldest), or None (wait, then refuse).
* ``expired``: detached sessions past their grace period.
* ``over_detached``: detached sessions beyond the node's bound on them (the
  oldest first), to free as soon as one more is detached.
* ``supersedes``: may a resume end a live stream of its session (its
  upstream went silent) and take the session over?
* ``overrun``: a stream that has sent steps or grants beyond its credits
  this many times is cut.

A node's session slots (``--max-sessions``) bound its KV memory whatever
these say; these bound what one party can make a node do within them.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

from meshnode import errors
from meshnode.http.ratelimit import RateTable


def open_rate(table: RateTable, initiator: str, now: float, per_minute: float) -> None:
    """CapacityError if ``initiator`` opened its burst and its rate's worth of sessions already."""
    wait = table.take(initiator, now)
    if wait > 0:
        raise errors.CapacityError(f"initiator {initiator} opens more sessions on this node than {per_minute:g} a "
                                   f"minute (--max-opens-per-minute); retry in {wait:.1f}s")


def room(detached_at: Mapping[str, float]) -> str | None:
    """The detached session to evict for an open that finds no free slot: the one detached longest ago."""
    return min(detached_at, key=lambda k: detached_at[k]) if detached_at else None


def expired(detached_at: Mapping[str, float], now: float, grace: float) -> list[str]:
    """Detached sessions whose grace period (seconds) is over."""
    return [sid for sid, at in detached_at.items() if now - at >= grace]


def over_detached(detached_at: Mapping[str, float], bound: int) -> list[str]:
    """Before one more is detached: the oldest detached sessions to free so that at most ``bound`` remain."""
    extra = len(detached_at) + 1 - bound
    return sorted(detached_at, key=lambda k: detached_at[k])[:extra] if extra > 0 else []


def supersedes(old_initiator: str, old_epoch: int, new_initiator: str, new_epoch: int) -> bool:
    """May a resume end a session's live stream and take the session over? Only its own initiator's, under a
    later epoch: the initiator has given that stream up (its upstream may have gone silent: a partition)."""
    return new_initiator == old_initiator and new_epoch > old_epoch


def overrun(count: int, limit: int) -> bool:
    """The stream has gone beyond its credits ``count`` times: cut it once past ``limit``."""
    return count > limit


class Recent:
    """A set that remembers the last ``size`` keys added (ids cancelled before their open, work ids
    cancelled in a session): what strangers can add to it is bounded."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
