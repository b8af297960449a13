"""Which sessions are audited: every session through a node still on probation, then a fraction.

A node id this initiator has seen fewer than ``probation`` clean audited sessions of is audited
every time; after that a session is audited with probability ``rate``. The ledger of clean
sessions lives in the initiator's state dir (``audits.json``), so one-shot ``meshnode generate``
runs build it up like a long-running API server does. A node that behaves during probation and
lies later is caught in a session it lies in with probability ``rate``: after m such sessions,
1 - (1 - rate)^m (docs/security.md, "A hop that lies").
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from meshnode import atomicfile

log = logging.getLogger("meshnode.audit")

LEDGER = "audits.json"
#: node ids the ledger keeps (the most recently audited)
MAX_LEDGER = 4096


@dataclass(frozen=True)
class AuditPolicy:
    #: probability that a session is audited once its nodes are past probation (0 = never, 1 = always)
    rate: float = 0.1
    #: clean audited sessions a node id needs before ``rate`` applies to it
    probation: int = 3
    #: steps between two checks of an audited session (a lie is caught at the first check after it)
    every: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"audit rate {self.rate} is outside [0, 1]")
        if self.every < 1 or self.probation < 0:
            raise ValueError("audit every must be >= 1 and probation >= 0")


DEFAULT_AUDIT = AuditPolicy()
OFF = AuditPolicy(rate=0.0, probation=0)


class Ledger:
    """Clean audited sessions per node id, kept in ``state_dir/audits.json`` (best effort)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = state_dir / LEDGER if state_dir is not None else None
        self.clean: dict[str, int] = {}
        if self.path is not None and self.path.exists():
            try:
                raw = json.loads(self.path.read_text())
                self.clean = {str(k): int(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
            except (OSError, ValueError) as e:
                log.warning("audit ledger %s is unreadable (%s): every node starts on probation", self.path, e)

    def audited(self, node_ids: Iterable[str], policy: AuditPolicy, rng: random.Random) -> bool:
        """Audit this session? Always while any of its nodes is on probation, else with ``rate``."""
        if policy.rate <= 0 and policy.probation <= 0:
            return False
        if any(self.clean.get(n, 0) < policy.probation for n in node_ids):
            return True
        return rng.random() < policy.rate

    def passed(self, node_ids: Iterable[str]) -> None:
        """These nodes' steps in an audited session all checked out."""
        for n in node_ids:
            self.clean[n] = self.clean.pop(n, 0) + 1  # re-inserted last: the most recent are kept
        while len(self.clean) > MAX_LEDGER:
            del self.clean[next(iter(self.clean))]
        if self.path is not None:
            try:
                atomicfile.write(self.path, json.dumps(self.clean).encode(), 0o600)
            except OSError as e:
                log.warning("could not save the audit ledger %s: %s", self.path, e)
