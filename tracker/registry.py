"""The tracker's registry, kept in SQLite so a restart loses nothing within TTL.

Every write goes through ``register`` after ``verify_advert`` accepted the
envelope; the row keeps the exact signed bytes, so a lookup hands clients
what the node signed, for them to verify again.

Next to the rows, ``probes`` holds what the tracker's own probes found
(tracker/probe.py), and ``series`` the samples of each node's token counter
for the charts: in memory only, since a restarted tracker probes again
within seconds.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.identity.attest import CLOCK_SKEW
from meshnode.proto import node_pb2 as pb
from meshnode.web.mapseries import SeriesBook
from tracker.limits import Bounds, RateTable, Slot, place
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
CREATE TABLE IF NOT EXISTS misbehaving (  -- node ids caught lying (a recomputation confirmed it): kept for good
    node_id   TEXT PRIMARY KEY,
    model     TEXT NOT NULL,     -- the model fingerprint of the evidence
    range_start INTEGER NOT NULL,
    range_end INTEGER NOT NULL,
    pos_start INTEGER NOT NULL,  -- the first chunk whose sealed output the recomputation refuted
    reporter  TEXT NOT NULL,     -- node id that signed the evidence
    at        REAL NOT NULL,     -- when the lie was confirmed, tracker clock
    evidence  TEXT NOT NULL      -- sha256 of the evidence as posted
);
"""
#: node ids marked misbehaving at most: every mark costs a recomputation (bounded in rate and one at a time)
MAX_MARKS = 100_000
#: columns added since the first schema: (table, column, definition)
ADDED = (("nodes", "source", "TEXT NOT NULL DEFAULT ''"),  # the address it registered from
         ("seqs", "at", "REAL NOT NULL DEFAULT 0"))        # when that seq was accepted
#: a seq is forgotten this long after it was accepted: any advertisement of that node issued before
#: it is older than CLOCK_SKEW by then, refused as stale whatever its seq
SEQ_MEMORY = 2 * CLOCK_SKEW + 60
#: seconds between sweeps of forgotten seqs
SWEEP_EVERY = 60.0


@dataclass(frozen=True)
class Entry:
    node_id: str
    envelope: pb.SignedEnvelope
    advert: pb.Advertisement
    last_seen: float
    first_seen: float
    #: the address it registered from (bounds per source: tracker/limits.py)
    source: str = ""

    #: the first endpoint it advertises (the one probed)
    endpoint: str | None = None


@dataclass
class _Index:
    """The live entries in memory (SQLite keeps them across restarts): lookups never parse a row."""

    entries: dict[str, Entry] = field(default_factory=dict)
    per_source: dict[str, int] = field(default_factory=dict)
    #: (model fingerprint, name, file) as claimed -> the node ids claiming it (a lookup matches its query once
    #: per distinct claim, not per node)
    by_model: dict[tuple[str, str, str], set[str]] = field(default_factory=dict)

    def put(self, e: Entry) -> None:
        self.drop(e.node_id)
        self.entries[e.node_id] = e
        self.per_source[e.source] = self.per_source.get(e.source, 0) + 1
        self.by_model.setdefault(_claim(e), set()).add(e.node_id)

    def drop(self, node_id: str) -> None:
        old = self.entries.pop(node_id, None)
        if old is not None:
            left = self.per_source[old.source] - 1
            if left:
                self.per_source[old.source] = left
            else:
                del self.per_source[old.source]
            model = _claim(old)
            ids = self.by_model[model]
            ids.discard(node_id)
            if not ids:
                del self.by_model[model]


def _first_endpoint(ad: pb.Advertisement) -> str | None:
    eps = ad.capability.endpoints
    return eps[0] if eps else None


def _claim(e: Entry) -> tuple[str, str, str]:
    cap = e.advert.capability
    return cap.model_fingerprint, cap.model_name, cap.model_file


@dataclass(frozen=True)
class Mark:
    """A node id caught lying: what a confirmed piece of evidence showed."""

    node_id: str
    model: str
    range: tuple[int, int]
    pos_start: int
    reporter: str
    at: float
    evidence: str


class Registry:
    def __init__(self, path: Path | str, ttl: float, *, fail_limit: int = FAIL_LIMIT,
                 bounds: Bounds | None = None) -> None:
        self.ttl = ttl
        self.bounds = bounds or Bounds()
        #: registrations per source address (tracker/limits.py)
        self.rates = RateTable(self.bounds.per_source_per_minute / 60.0, self.bounds.per_source_burst)
        #: the prober's findings per node id (tracker/liveness.py)
        self.probes = ProbeBook(fail_limit)
        #: samples of each node's tokens_total for the charts (meshnode/web/mapseries.py): in memory only
        self.series = SeriesBook()
        self.db = sqlite3.connect(str(path))
        self.db.executescript(SCHEMA)
        now = time.time()
        with self.db:
            for table, column, definition in ADDED:
                have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            self.db.execute("UPDATE seqs SET at = ? WHERE at = 0", (now,))  # rows from before the column
        self._index = _Index()
        for nid, blob, last, first, source in self.db.execute(
                "SELECT node_id, envelope, last_seen, first_seen, source FROM nodes"):
            env = pb.SignedEnvelope.FromString(blob)
            ad = pb.Advertisement.FromString(env.payload)
            self._index.put(Entry(nid, env, ad, last, first, source, _first_endpoint(ad)))
        #: node ids caught lying, never forgotten (tracker/evidence.py marks them)
        self.marks: dict[str, Mark] = {
            row[0]: Mark(row[0], row[1], (row[2], row[3]), row[4], row[5], row[6], row[7]) for row in self.db.execute(
                "SELECT node_id, model, range_start, range_end, pos_start, reporter, at, evidence FROM misbehaving")}
        self._swept = 0.0

    def close(self) -> None:
        self.db.close()

    def last_seq(self, node_id: str) -> int | None:
        row = self.db.execute("SELECT seq FROM seqs WHERE node_id = ?", (node_id,)).fetchone()
        return None if row is None else int(row[0])

    def place(self, node_id: str, source: str, now: float) -> Slot:
        """Whether ``node_id`` registering from ``source`` may be listed (tracker/limits.py ``place``)."""
        self._expire(now)
        idx = self._index
        known = node_id in idx.entries
        victim = None
        if not known and len(idx.entries) >= self.bounds.max_entries:
            unreached = [e for e in idx.entries.values() if not self._reached(e.node_id)]
            victim = min(unreached, key=lambda e: e.last_seen).node_id if unreached else None
        return place(known, source, idx.per_source.get(source, 0), len(idx.entries), victim, self.bounds)

    def mark(self, m: Mark) -> bool:
        """Mark ``m.node_id`` misbehaving, for good (the first confirmed lie is kept); False: the table is full."""
        if m.node_id in self.marks:
            return True
        if len(self.marks) >= MAX_MARKS:
            return False
        with self.db:
            self.db.execute("INSERT INTO misbehaving(node_id, model, range_start, range_end, pos_start, reporter, at, "
                            "evidence) VALUES(?, ?, ?, ?, ?, ?, ?, ?)",
                            (m.node_id, m.model, m.range[0], m.range[1], m.pos_start, m.reporter, m.at, m.evidence))
        self.marks[m.node_id] = m
        return True

    def _reached(self, node_id: str) -> bool:
        s = self.probes.states.get(node_id)
        return s is not None and s.last_ok is not None

    def remove(self, node_id: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))
        self._index.drop(node_id)
        self.probes.states.pop(node_id, None)
        self.series.tracks.pop(node_id, None)

    def register(self, env: pb.SignedEnvelope, ad: pb.Advertisement, now: float, source: str = "") -> None:
        nid = ad.capability.node_id
        with self.db:
            self.db.execute("INSERT INTO seqs(node_id, seq, at) VALUES(?, ?, ?) "
                            "ON CONFLICT(node_id) DO UPDATE SET seq = excluded.seq, at = excluded.at",
                            (nid, ad.seq, now))
        if ad.leaving:
            self.remove(nid)
            return
        old = self._index.entries.get(nid)
        first = old.first_seen if old is not None else now
        with self.db:
            self.db.execute(
                "INSERT INTO nodes(node_id, envelope, seq, last_seen, first_seen, source) VALUES(?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET envelope = excluded.envelope, seq = excluded.seq, "
                "last_seen = excluded.last_seen, source = excluded.source",
                (nid, env.SerializeToString(), ad.seq, now, first, source),
            )
        self._index.put(Entry(nid, env, ad, now, first, source, _first_endpoint(ad)))

    def _expire(self, now: float) -> None:
        gone = [nid for nid, e in self._index.entries.items() if e.last_seen < now - self.ttl]
        if gone:
            with self.db:
                self.db.execute("DELETE FROM nodes WHERE last_seen < ?", (now - self.ttl,))
            for nid in gone:
                self._index.drop(nid)
        if now - self._swept >= SWEEP_EVERY:
            self._swept = now
            with self.db:
                self.db.execute("DELETE FROM seqs WHERE at < ?", (now - SEQ_MEMORY,))
            self.probes.keep(self._index.entries)
            self.series.keep(self._index.entries)

    def live(self, now: float, models: Callable[[Entry], bool] | None = None) -> list[Entry]:
        """The entries heard from within the TTL, by node id; with ``models``, only those of the models it
        accepts (asked once per model, with one of its entries)."""
        self._expire(now)
        idx = self._index
        if models is None:
            ids: Iterable[str] = idx.entries
        else:
            ids = [nid for group in idx.by_model.values() if models(idx.entries[next(iter(group))]) for nid in group]
        return [idx.entries[k] for k in sorted(ids)]
