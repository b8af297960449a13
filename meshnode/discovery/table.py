"""The peer table: what this node knows of others, changed only by pure functions.

``apply(table, event, now)`` returns the new table; ``expire(table, now,
ttl)`` drops peers not seen within ``ttl``. Only peers whose signed
attestation verified are ever added (the feed checks before it emits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshnode.proto import node_pb2 as pb


@dataclass(frozen=True)
class PeerEntry:
    node_id: str
    endpoint: str
    capability: pb.Capability
    #: where it was learned: "mdns" or "tracker"
    source: str
    last_seen: float


@dataclass(frozen=True)
class Seen:
    entry: PeerEntry


@dataclass(frozen=True)
class Gone:
    node_id: str


Event = Seen | Gone


def apply(table: dict[str, PeerEntry], event: Event, now: float) -> dict[str, PeerEntry]:
    new = dict(table)
    if isinstance(event, Seen):
        new[event.entry.node_id] = replace(event.entry, last_seen=now)
    else:
        new.pop(event.node_id, None)
    return new


def expire(table: dict[str, PeerEntry], now: float, ttl: float) -> dict[str, PeerEntry]:
    return {k: v for k, v in table.items() if now - v.last_seen <= ttl}
