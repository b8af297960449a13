"""Prometheus metrics of a node, kept and rendered by ``prometheus_client``.

Each node has its own ``CollectorRegistry`` (never the process-global one:
several nodes may run in one test process). The session code updates the
metrics on the data plane's asyncio thread; ``GET /metrics`` of the node's
``--metrics`` listener renders them on the trio thread. prometheus_client
guards every value with a lock, so no hop between the two threads is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from starlette.types import ASGIApp

#: step latency buckets, seconds
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NodeMetrics:
    """The node's metrics (names and labels are what dashboards query: keep them stable)."""

    def __init__(self, live_sessions: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.sessions_open = Gauge("meshnode_sessions_open", "Route sessions holding KV state on this node",
                                   registry=reg)
        if live_sessions is not None:
            self.sessions_open.set_function(live_sessions)  # read when scraped: never stale
        self.sessions = Counter("meshnode_sessions_total", "Route sessions accepted", registry=reg)
        self.tokens = Counter("meshnode_tokens_total", "Token positions executed, by kind (prefill|decode)",
                              ["kind"], registry=reg)
        self.steps = Histogram("meshnode_step_seconds", "Time from receiving a step to having its result",
                               buckets=BUCKETS, registry=reg)
        self.bytes_in = Counter("meshnode_bytes_in_total", "Session stream bytes received", registry=reg)
        self.bytes_out = Counter("meshnode_bytes_out_total", "Session stream bytes sent", registry=reg)
        self.errors = Counter("meshnode_errors_total", "Errors answered, by error code", ["code"], registry=reg)
        self.link_messages = Counter("meshnode_link_messages_total", "Link messages, by direction (in|out)",
                                     ["direction"], registry=reg)
        self.link_entries = Counter("meshnode_link_entries_total", "Session frames and replies carried in link "
                                    "messages, by direction (in|out)", ["direction"], registry=reg)
        self.fetch_bytes = Counter("meshnode_fetch_bytes_served_total",
                                   "Model bytes sent to peers that fetch them (Fetch)", registry=reg)
        self.fetch_refused = Counter("meshnode_fetch_refused_total", "Fetches refused, by error code",
                                     ["code"], registry=reg)
        self.fetch_active = Gauge("meshnode_fetches_active", "Fetches being served", registry=reg)
        ProcessCollector(registry=reg)  # process_resident_memory_bytes, process_cpu_seconds_total, ...

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (text format, or OpenMetrics if ``accept`` asks for it) and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type

    def link(self, direction: str, entries: int) -> None:
        """One link message of ``entries`` session frames (in) or replies (out)."""
        self.link_messages.labels(direction=direction).inc()
        self.link_entries.labels(direction=direction).inc(entries)

    def tokens_total(self) -> int:
        return int(_sum(self.tokens, "_total"))

    def errors_total(self) -> int:
        return int(_sum(self.errors, "_total"))

    def step_seconds_mean(self) -> float:
        """Mean of the observed step latencies (0.0 before the first step)."""
        n = _sum(self.steps, "_count")
        return _sum(self.steps, "_sum") / n if n else 0.0

    def asgi(self) -> ASGIApp:
        """``GET /metrics``: the ASGI app the node's ``--metrics`` listener serves."""
        from starlette.requests import Request  # the HTTP stack only for a node that serves metrics
        from starlette.responses import Response
        from starlette.routing import Route

        from meshnode.http.serve import asgi_app

        async def scrape(request: Request) -> Response:
            body, content_type = self.render(request.headers.get("accept", ""))
            return Response(body, media_type=content_type)

        return asgi_app([Route("/metrics", scrape, methods=["GET"])])


def _sum(metric: Counter | Histogram, suffix: str) -> float:
    """The sum over all label sets of one metric's samples named ``<name><suffix>``."""
    return sum(s.value for family in metric.collect() for s in family.samples if s.name.endswith(suffix))
