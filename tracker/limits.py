"""What a stranger can make the tracker store and do: the bounds, and the pure decisions under them.

Anyone can make an Ed25519 key and sign a valid advertisement for it, so a
signature proves nothing about how many registrations one party may make.
The tracker bounds them by where they come from (the connection's source
address) and in total:

* **rate**: registrations per source per minute (a token bucket: a burst,
  then a steady rate). A node heartbeats every 10 s (6 a minute); the
  default leaves room for dozens of nodes behind one address. Checked before
  the signature is verified: a flood costs the tracker one dict lookup each.
* **entries per source**: live entries registered from one address. A new
  node id beyond it is refused (429); the nodes already listed from that
  address keep heartbeating.
* **evidence**: reports that a hop lied, per source per minute (a token bucket like
  registrations'); each may cost the tracker a recomputation (tracker/evidence.py).
* **entries in all**: the table's size. A new node id that finds it full takes
  the place of the entry that never answered a probe and was seen longest
  ago; entries the tracker reached (a probe answered) are never displaced by
  newcomers. With none to displace: 503.

The table of sources is itself bounded (meshnode/http/ratelimit.py). Pure: time
comes in as ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnode.http.ratelimit import RateTable

__all__ = ["Bounds", "RateTable", "Slot", "place"]


@dataclass(frozen=True)
class Bounds:
    #: registrations one source address may make per minute (steady rate)
    per_source_per_minute: float = 240.0
    #: registrations one source may make at once before the rate applies
    per_source_burst: float = 60.0
    #: live entries registered from one source address
    entries_per_source: int = 64
    #: live entries in all
    max_entries: int = 10_000
    #: evidence one source address may post per minute (each may cost a recomputation), after a burst
    evidence_per_minute: float = 6.0
    evidence_burst: float = 3.0


@dataclass(frozen=True)
class Slot:
    """Where a newcomer's registration goes: ``admit`` it, ``evict`` a node id first, or refuse with
    ``status`` and ``why``."""

    admit: bool
    evict: str | None = None
    status: int = 200
    why: str = ""


def place(known: bool, source: str, from_source: int, total: int, victim: str | None, bounds: Bounds) -> Slot:
    """May a node, registering from ``source``, be listed? Pure.

    ``known``: it is listed already (a heartbeat: always); ``from_source``: live entries registered
    from ``source``; ``total``: live entries in all; ``victim``: the unreached entry seen longest ago
    (None: every entry was reached by a probe). A newcomer within the per-source bound is listed,
    taking the victim's place when the table is full.
    """
    if known:
        return Slot(True)
    if from_source >= bounds.entries_per_source:
        return Slot(False, status=429, why=f"{from_source} nodes are listed from {source}, the most one address "
                                           f"may register (--max-per-source {bounds.entries_per_source})")
    if total < bounds.max_entries:
        return Slot(True)
    if victim is None:
        return Slot(False, status=503, why=f"the tracker lists {total} nodes, its most (--max-entries), "
                                           "every one reached by its probes")
    return Slot(True, evict=victim)
