"""Is a registered node alive? Pure decisions from the tracker's probes, heartbeats and the clock.

Two kinds of evidence reach the tracker:

* **heartbeats**: the node's signed advertisements; ``last_seen`` is the
  tracker's clock when the latest one was accepted;
* **probes**: the tracker's own bounded gRPC ``Health`` calls to the endpoint
  the node advertised (tracker/probe.py), every couple of seconds.

``judge`` turns them into a verdict:

1. no heartbeat for ``ttl`` seconds: dead (the registry drops the entry too);
2. a node that has never answered a probe is judged by heartbeats alone: a
   tracker that cannot reach a node (NAT, a firewall, another network) must
   not call it dead while it keeps heartbeating;
3. ``fail_limit`` consecutive failed probes, and no heartbeat since the
   latest of them started: dead (a SIGKILLed node is shown dead within
   a probe period and a retry -- tracker/probe.py probes a failing node
   again at once -- not when its TTL ends);
4. otherwise alive. A later successful probe resets the failure count; a
   heartbeat after the last failed probe revives the node until the next
   probe fails.

Everything here is a function of data and ``now``; tracker/probe.py does the I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from meshnode.proto import node_pb2 as pb

#: consecutive failed probes after which a node that answered before is dead
FAIL_LIMIT = 2

#: ``host:port`` with a DNS name, an IPv4 address or a bracketed IPv6 address; nothing a gRPC
#: target would read as a scheme (``unix:``, ``dns:///``, ``ipv4:``...)
_TARGET = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5})")


def probe_target(endpoint: str) -> str | None:
    """The gRPC target to probe for an advertised endpoint, or None if it is not a plain HOST:PORT.

    An endpoint is the node's own claim (signed, but by anyone's key): the
    tracker probes only ``host:port`` forms, never a unix socket or a
    resolver scheme a gRPC target string could otherwise name.
    """
    m = _TARGET.fullmatch(endpoint)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        return None
    return endpoint


@dataclass(frozen=True)
class Probe:
    """The outcome of one probe."""

    #: tracker clock (seconds) when the probe started: it says nothing of what happened after
    at: float
    #: the node answered Health in time
    ok: bool
    #: its answer (live counters), when ok
    health: pb.HealthReply | None = None
    #: why it failed (one line), when not ok
    error: str = ""
    #: seconds the probe took
    seconds: float = 0.0


@dataclass(frozen=True)
class ProbeState:
    """What the tracker's probes know of one node's endpoint."""

    #: the endpoint these probes went to (a new endpoint starts a fresh state)
    endpoint: str
    #: failed probes since the last successful one
    failures: int = 0
    #: start of the last successful probe (None: never answered)
    last_ok: float | None = None
    #: start of the last failed probe
    last_failed: float | None = None
    #: start of the last probe of either kind
    last_probe: float | None = None
    #: the last failure's message
    error: str = ""
    #: the last successful probe's Health answer
    health: pb.HealthReply | None = None
    #: seconds the last successful probe took
    rtt: float = 0.0
    #: probes answered / failed since the tracker started
    ok_total: int = 0
    failed_total: int = 0


def record(state: ProbeState | None, endpoint: str, probe: Probe) -> ProbeState:
    """The state after ``probe`` of ``endpoint``."""
    if state is None or state.endpoint != endpoint:
        state = ProbeState(endpoint)
    if probe.ok:
        return replace(state, failures=0, last_ok=probe.at, last_probe=probe.at, error="", health=probe.health,
                       rtt=probe.seconds, ok_total=state.ok_total + 1)
    return replace(state, failures=state.failures + 1, last_failed=probe.at, last_probe=probe.at,
                   error=probe.error, failed_total=state.failed_total + 1)


@dataclass(frozen=True)
class Verdict:
    alive: bool
    #: one line for the page: why
    reason: str
    #: what decided it: "probe" (the tracker's own probes) or "heartbeat" (the node's adverts alone)
    by: str


def judge(state: ProbeState | None, last_seen: float, now: float, ttl: float,
          fail_limit: int = FAIL_LIMIT) -> Verdict:
    """Alive or dead, and why (rules 1-4 of the module docstring)."""
    silent = now - last_seen
    if silent > ttl:
        return Verdict(False, f"no heartbeat for {silent:.0f} s (ttl {ttl:g} s)", "heartbeat")
    if state is None or state.last_ok is None:
        note = f"; not reachable from the tracker ({state.error})" if state is not None and state.failures else ""
        return Verdict(True, f"heartbeat {silent:.0f} s ago{note}", "heartbeat")
    assert state.last_probe is not None
    if state.failures >= fail_limit and state.last_failed is not None and last_seen <= state.last_failed:
        return Verdict(False, f"{state.failures} probes failed: {state.error}", "probe")
    if state.failures:
        return Verdict(True, f"{_probes(state.failures)} failed ({state.error}); heartbeat {silent:.0f} s ago",
                       "probe")
    return Verdict(True, f"answered a probe {max(0.0, now - state.last_ok):.1f} s ago", "probe")


def alive(state: ProbeState | None, last_seen: float, now: float, ttl: float, fail_limit: int = FAIL_LIMIT) -> bool:
    """``judge(...).alive`` without the reason (a lookup ranks thousands of entries and shows a few)."""
    if now - last_seen > ttl:
        return False
    if state is None or state.last_ok is None:
        return True
    return not (state.failures >= fail_limit and state.last_failed is not None and last_seen <= state.last_failed)


def _probes(n: int) -> str:
    return "1 probe" if n == 1 else f"{n} probes"


@dataclass(frozen=True)
class Counters:
    """The freshest live counters of a node, and where they come from."""

    health: pb.HealthReply
    #: "probe" (the tracker's last Health call) or "heartbeat" (the node's last advertisement)
    source: str
    #: tracker clock when they were taken
    at: float


def freshest(heartbeat: pb.HealthReply, last_seen: float, state: ProbeState | None) -> Counters:
    """The heartbeat's counters, or the last probe's when that probe is newer."""
    if state is not None and state.health is not None and state.last_ok is not None and state.last_ok > last_seen:
        return Counters(state.health, "probe", state.last_ok)
    return Counters(heartbeat, "heartbeat", last_seen)


@dataclass(frozen=True)
class Target:
    node_id: str
    #: the gRPC target (probe_target of the advertised endpoint)
    endpoint: str


def pick(candidates: Iterable[tuple[str, str]], states: Mapping[str, ProbeState], busy: Iterable[str] = (),
         cap: int = 256) -> list[Target]:
    """Which (node id, endpoint) pairs to probe this round: at most ``cap``, least recently probed first.

    Endpoints that are not plain HOST:PORT are skipped; an endpoint advertised
    by several entries is probed once; ``busy`` node ids (a probe still in
    flight) are skipped, so a slow node never holds more than one probe.
    """
    skip, seen, out = set(busy), set(), []
    for nid, ep in candidates:
        target = probe_target(ep)
        if target is None or nid in skip or target in seen:
            continue
        seen.add(target)
        out.append(Target(nid, target))

    def age(t: Target) -> tuple[float, str]:
        s = states.get(t.node_id)
        last = s.last_probe if s is not None and s.endpoint == t.endpoint else None
        return (float("-inf") if last is None else last, t.node_id)

    return sorted(out, key=age)[:max(cap, 0)]


@dataclass
class ProbeBook:
    """The probes' state per node id: written by the prober, read by the views (both on trio's thread)."""

    #: consecutive failed probes that make a node dead
    fail_limit: int = FAIL_LIMIT
    states: dict[str, ProbeState] = field(default_factory=dict)

    def record(self, node_id: str, endpoint: str, probe: Probe) -> None:
        self.states[node_id] = record(self.states.get(node_id), endpoint, probe)

    def get(self, node_id: str, endpoint: str | None = None) -> ProbeState | None:
        """The state of ``node_id``'s probes, if they went to ``endpoint`` (when given)."""
        s = self.states.get(node_id)
        if s is None or (endpoint is not None and probe_target(endpoint) != s.endpoint):
            return None
        return s

    def keep(self, node_ids: Iterable[str]) -> None:
        """Forget nodes no longer registered."""
        live = set(node_ids)
        for nid in [n for n in self.states if n not in live]:
            del self.states[nid]
