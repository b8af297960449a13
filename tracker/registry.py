"""The tracker's registry, kept in SQLite so a restart loses nothing within TTL.

Every write goes through ``register`` after ``verify_advert`` accepted the
envelope; the row keeps the exact signed bytes, so a lookup hands clients
what the node signed, for them to verify again.

Next to the rows, ``probes`` holds what the tracker's own probes found
(tracker/probe.py): in memory only, since a restarted tracker probes again
within seconds.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from meshnode.proto import node_pb2 as pb
from tracker.liveness import FAIL_LIMIT, ProbeBook

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id   TEXT PRIMARY KEY,
    envelope  BLOB NOT NULL,   -- the SignedEnvelope exactly as registered
    seq       INTEGER NOT NULL,
    last_seen REAL NOT NULL,   -- tracker clock, seconds
    first_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS seqs (  -- survives expiry: a replay stays refused
    node_id TEXT PRIMARY KEY,
    seq     INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class Entry:
    node_id: str
    envelope: pb.SignedEnvelope
    advert: pb.Advertisement
    last_seen: float
    first_seen: float


class Registry:
    def __init__(self, path: Path | str, ttl: float, *, fail_limit: int = FAIL_LIMIT) -> None:
        self.ttl = ttl
        #: the prober's findings per node id (tracker/liveness.py)
        self.probes = ProbeBook(fail_limit)
        self.db = sqlite3.connect(str(path))
        self.db.executescript(SCHEMA)
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    def last_seq(self, node_id: str) -> int | None:
        row = self.db.execute("SELECT seq FROM seqs WHERE node_id = ?", (node_id,)).fetchone()
        return None if row is None else int(row[0])

    def register(self, env: pb.SignedEnvelope, ad: pb.Advertisement, now: float) -> None:
        nid = ad.capability.node_id
        with self.db:
            self.db.execute("INSERT INTO seqs(node_id, seq) VALUES(?, ?) ON CONFLICT(node_id) DO UPDATE SET seq = ?",
                            (nid, ad.seq, ad.seq))
            if ad.leaving:
                self.db.execute("DELETE FROM nodes WHERE node_id = ?", (nid,))
                self.probes.states.pop(nid, None)
                return
            self.db.execute(
                "INSERT INTO nodes(node_id, envelope, seq, last_seen, first_seen) VALUES(?, ?, ?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET envelope = excluded.envelope, seq = excluded.seq, "
                "last_seen = excluded.last_seen",
                (nid, env.SerializeToString(), ad.seq, now, now),
            )

    def live(self, now: float) -> list[Entry]:
        with self.db:
            self.db.execute("DELETE FROM nodes WHERE last_seen < ?", (now - self.ttl,))
        out = []
        for nid, blob, last, first in self.db.execute(
            "SELECT node_id, envelope, last_seen, first_seen FROM nodes ORDER BY node_id"
        ):
            env = pb.SignedEnvelope.FromString(blob)
            out.append(Entry(nid, env, pb.Advertisement.FromString(env.payload), last, first))
        return out
