"""Tokens/s over the last 15 minutes, from samples of each node's ``tokens_total`` counter.

``SeriesBook`` keeps, per node, samples of (time, tokens_total) taken from
the freshest counters a reader has (the tracker: its probes and the nodes'
heartbeats; a gateway: its own Health calls), bounded in time (the window),
in spacing (one sample per ``spacing`` seconds) and in nodes. The rest is
pure: ``bucket_rates`` turns one node's samples into a tokens/s value per
fixed time bucket, ``total`` adds series together (a model's rate: the sum
over the nodes serving its last layer).

Definitions (docs/tracker.md, "Charts"):

* a node's **tokens/s** over a bucket is the time-weighted mean of the rates
  between its consecutive samples, ``(tokens_b - tokens_a) / (t_b - t_a)``,
  over the parts of the bucket its samples span; ``tokens_total`` counts
  token positions the node executed (prefill and decode), so a hop of a
  route running a 100-token prompt executes 100 positions;
* a counter that went down (the node restarted) or a pair of samples more
  than ``MAX_GAP`` seconds apart says nothing of that interval: no value;
  a bucket whose known part is under half of it has no value (a gap in the
  chart, not a made-up zero);
* a **model's** tokens/s is the sum of the rates of the nodes serving its
  last layer: every position a route of that model runs passes through one
  of them exactly once.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: seconds of history kept and charted
WINDOW = 900.0
#: seconds between two kept samples of one node at least (a closer one is dropped): at most
#: WINDOW / SPACING + 2 samples a node
SPACING = 1.5
#: nodes with a series at most
MAX_NODES = 512
#: seconds between two samples beyond which the interval has no rate (the node was not heard from)
MAX_GAP = 60.0
#: the charts' bucket width, seconds, unless asked otherwise; and the bounds of what may be asked
STEP = 5.0
MIN_STEP, MAX_STEP = 2.0, 60.0
MIN_WINDOW = 60.0
#: a bucket needs samples over at least this share of it to have a value
MIN_KNOWN = 0.5

Sample = tuple[float, int]


@dataclass
class Track:
    """One node's samples, oldest first."""

    #: (time, tokens_total) pairs, times strictly increasing, at least ``SPACING`` apart
    samples: deque[Sample]
    #: a tracker probe (not only the node's own heartbeat) reached it: such a series may displace
    #: one only heard of
    probed: bool = False


@dataclass
class SeriesBook:
    """Per node, its samples of the last ``window`` seconds; at most ``max_nodes`` nodes."""

    window: float = WINDOW
    spacing: float = SPACING
    max_nodes: int = MAX_NODES
    tracks: dict[str, Track] = field(default_factory=dict)

    def add(self, node_id: str, at: float, tokens: int, *, probed: bool = False) -> bool:
        """Keep the sample (``at``: the reader's clock; ``tokens``: the node's tokens_total) if it is
        ``spacing`` after the node's last one; False when dropped (too close, or no room)."""
        track = self.tracks.get(node_id)
        if track is None:
            if len(self.tracks) >= self.max_nodes:
                victim = displaced(self.tracks, probed)
                if victim is None:
                    return False
                del self.tracks[victim]
            track = self.tracks[node_id] = Track(deque(maxlen=math.ceil(self.window / self.spacing) + 2))
        track.probed = track.probed or probed
        s = track.samples
        if s and at < s[-1][0] + self.spacing:
            return False
        s.append((at, max(0, int(tokens))))
        while s[0][0] < at - self.window - MAX_GAP:  # one sample before the window stays: the first bucket's rate
            s.popleft()
        return True

    def keep(self, node_ids: Iterable[str]) -> None:
        """Forget the series of nodes no longer known."""
        known = set(node_ids)
        for nid in [n for n in self.tracks if n not in known]:
            del self.tracks[nid]

    def samples(self, node_id: str) -> list[Sample]:
        track = self.tracks.get(node_id)
        return list(track.samples) if track is not None else []


def displaced(tracks: dict[str, Track], probed: bool) -> str | None:
    """Which series a new one takes the place of in a full book: for a node a probe reached, the one only
    heard of (never probed) that was updated longest ago; else none (a flood of node ids that only
    heartbeat cannot push out the series of nodes the reader reaches)."""
    if not probed:
        return None
    heard = [(t.samples[-1][0] if t.samples else -math.inf, nid) for nid, t in tracks.items() if not t.probed]
    return min(heard)[1] if heard else None


def grid(now: float, window: float = WINDOW, step: float = STEP) -> tuple[float, int]:
    """The end of the last complete bucket (a multiple of ``step``) and the number of buckets in ``window``."""
    return math.floor(now / step) * step, max(1, round(window / step))


def pair_rates(samples: Sequence[Sample]) -> list[tuple[float, float, float | None]]:
    """(start, end, tokens/s) of each interval between consecutive samples; None where it says nothing
    (the counter went down, or the samples are more than MAX_GAP apart)."""
    out: list[tuple[float, float, float | None]] = []
    for (t0, v0), (t1, v1) in itertools.pairwise(samples):
        if t1 <= t0:
            continue
        known = v1 >= v0 and t1 - t0 <= MAX_GAP
        out.append((t0, t1, (v1 - v0) / (t1 - t0) if known else None))
    return out


def bucket_rates(samples: Sequence[Sample], end: float, step: float, n: int) -> list[float | None]:
    """Tokens/s in each of the ``n`` buckets of ``step`` seconds ending at ``end`` (oldest first): the
    time-weighted mean of the known interval rates over the bucket, None if they span under MIN_KNOWN
    of it. One pass over intervals and buckets together."""
    pairs = pair_rates(samples)
    out: list[float | None] = []
    i = 0
    for b in range(n):
        b0 = end - (n - b) * step
        b1 = b0 + step
        while i < len(pairs) and pairs[i][1] <= b0:
            i += 1
        known = weighted = 0.0
        j = i
        while j < len(pairs) and pairs[j][0] < b1:
            t0, t1, rate = pairs[j]
            overlap = min(t1, b1) - max(t0, b0)
            if rate is not None and overlap > 0:
                known += overlap
                weighted += rate * overlap
            j += 1
        out.append(round(weighted / known, 2) if known >= MIN_KNOWN * step else None)
    return out


def total(series: Iterable[Sequence[float | None]], n: int) -> list[float | None]:
    """The bucket-wise sum of ``series`` (each ``n`` long); None where none of them has a value."""
    out: list[float | None] = [None] * n
    for s in series:
        for k, v in enumerate(s[:n]):
            if v is not None:
                prev = out[k]
                out[k] = round(v + (prev or 0.0), 2)
    return out


@dataclass(frozen=True)
class Charted:
    """What one node's line needs: its id, model and whether it serves the model's last layer."""

    node_id: str
    #: model fingerprint
    model: str
    #: the model's name (general.name), for the chart's title
    model_name: str
    #: serves the model's last layer: counts toward the model's tokens/s
    tail: bool


#: the definition the pages print under the charts
DEFINITION = ("tokens/s: token positions executed per second (prefill and decode), from each node's "
              "tokens_total counter; a model's: the sum over the nodes serving its last layer "
              "(every position a route runs passes through one of them once)")


def series_doc(book: SeriesBook, nodes: Sequence[Charted], now: float, window: float = WINDOW,
               step: float = STEP) -> dict[str, object]:
    """The charts' JSON: the bucket ends (unix seconds), then tokens/s per node and per model."""
    end, n = grid(now, window, step)
    times = [round(end - (n - 1 - k) * step, 3) for k in range(n)]
    per_node = {c.node_id: bucket_rates(book.samples(c.node_id), end, step, n) for c in nodes}
    names: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    tails: dict[str, list[str]] = {}
    for c in nodes:
        names.setdefault(c.model, c.model_name)
        members.setdefault(c.model, []).append(c.node_id)
        tails.setdefault(c.model, [])
        if c.tail:
            tails[c.model].append(c.node_id)
    models = {fp: {"name": names[fp], "nodes": members[fp], "tails": tails[fp],
                   "tokens_per_second": total((per_node[t] for t in tails[fp]), n)} for fp in names}
    return {"window_seconds": n * step, "step_seconds": step, "t": times, "nodes": per_node, "models": models,
            "definition": DEFINITION}


def parse_window(window: str | None, step: str | None) -> tuple[float, float]:
    """``?window=&step=`` of a series request: seconds, clamped to [MIN_WINDOW, WINDOW] and [MIN_STEP,
    MAX_STEP]; ValueError for what is not a finite number."""
    w = _number(window, WINDOW)
    s = _number(step, STEP)
    return min(max(w, MIN_WINDOW), WINDOW), min(max(s, MIN_STEP), MAX_STEP)


def _number(text: str | None, default: float) -> float:
    if text is None or text == "":
        return default
    if len(text) > 32:
        raise ValueError("a number of at most 32 characters")
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a finite number")
    return v
