"""Prometheus metrics of a node, in the text exposition format (version 0.0.4).

A deliberately small registry: counters, gauges and one histogram, with
labels; rendered on ``GET /metrics`` of the node's ``--metrics`` listener.
Updated from the session code on the event-loop thread only.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

#: step latency buckets, seconds
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels)
    return "{" + inner + "}"


@dataclass
class Metric:
    name: str
    help: str
    kind: str  # counter | gauge
    values: dict[tuple[tuple[str, str], ...], float] = field(default_factory=lambda: defaultdict(float))

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    #: a gauge read when rendered (its value is never stale)
    source: Callable[[], float] | None = None

    def render(self) -> list[str]:
        if self.source is not None:
            self.set(self.source())
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        out += [f"{self.name}{_labels(k)} {v:g}" for k, v in sorted(self.values.items())] or [f"{self.name} 0"]
        return out


@dataclass
class Histogram:
    name: str
    help: str
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for le, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            acc += n
            out.append(f'{self.name}_bucket{{le="{"+Inf" if le == float("inf") else f"{le:g}"}"}} {acc}')
        out += [f"{self.name}_sum {self.total:g}", f"{self.name}_count {acc}"]
        return out


class NodeMetrics:
    def __init__(self, live_sessions: Callable[[], float] | None = None) -> None:
        self.sessions_open = Metric("meshnode_sessions_open", "Route sessions holding KV state on this node", "gauge",
                                    source=live_sessions)
        self.sessions = Metric("meshnode_sessions_total", "Route sessions accepted", "counter")
        self.tokens = Metric("meshnode_tokens_total", "Token positions executed, by kind (prefill|decode)", "counter")
        self.steps = Histogram("meshnode_step_seconds", "Time from receiving a step to having its result")
        self.bytes_in = Metric("meshnode_bytes_in_total", "Session stream bytes received", "counter")
        self.bytes_out = Metric("meshnode_bytes_out_total", "Session stream bytes sent", "counter")
        self.errors = Metric("meshnode_errors_total", "Errors answered, by error code", "counter")

    def render(self) -> str:
        parts: list[Metric | Histogram] = [
            self.sessions_open, self.sessions, self.tokens, self.steps, self.bytes_in, self.bytes_out, self.errors
        ]
        return "\n".join(line for m in parts for line in m.render()) + "\n"
