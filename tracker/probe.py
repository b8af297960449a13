"""The tracker's prober: a bounded gRPC ``Health`` call to each verified registration, every few seconds.

What it decides is pure and lives in tracker/liveness.py; this module does
the I/O. Each round (every ``ProbeConfig.every`` seconds, on a fixed
schedule) takes the registry's live entries, picks at most
``max_per_round`` of them, least recently probed first, and starts one
probe task per node. A round never waits for its probes: a node that is
slow to answer holds only its own probe (at most one in flight per node,
each bounded by ``timeout``), and every other node is probed on time. A
node that answered before and fails a probe is probed again ``retry``
seconds later (not a round later) until it answers or is dead, so a killed
node is dead within about ``every + retry`` seconds.

Only endpoints of registrations the tracker verified are probed, only in
plain ``HOST:PORT`` form, each at most once per round; at most
``max_in_flight`` probes run at once. The Health answer also carries the
node's live counters, which the page shows when they are newer than the
last heartbeat's, and each one is a sample of the node's token counter for
the page's charts (``Registry.series``).

gRPC's asyncio API has no trio support: the probes run on an asyncio loop on
a thread of its own (meshnode/transport/aiothread.py, the node's bridge), and
results come back to trio, where the registry's ``ProbeBook`` is written.
Cancelling ``run_prober`` cancels the probes in flight and stops that thread.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import trio

from meshnode import errors
from meshnode.transport.aiothread import AioRun, open_aio_thread
from meshnode.transport.client import health
from tracker.liveness import Probe, ProbeState, Target, pick
from tracker.registry import Registry

log = logging.getLogger("meshnode.tracker.probe")

#: seconds, beyond a probe's own gRPC deadline, before trio gives up on it (channel set-up, the bridge)
SLACK = 1.0
#: characters of a failure message kept for the page
ERROR_CHARS = 160


@dataclass(frozen=True)
class ProbeConfig:
    #: seconds between the starts of two rounds
    every: float = 2.0
    #: the gRPC deadline of one Health call, in seconds
    timeout: float = 1.5
    #: probes running at once, over all rounds
    max_in_flight: int = 32
    #: nodes one round probes at most (the least recently probed first)
    max_per_round: int = 256
    #: seconds after a failed probe of a node that had answered before until it is probed again, until it
    #: answers or is dead (``fail_limit`` failures): a node killed is shown dead within about
    #: ``every + retry`` seconds, not ``fail_limit`` rounds; 0: no early probe
    retry: float = 0.5


#: what gRPC's long UNAVAILABLE details mean, in the page's words (the first that occurs wins)
_CAUSES = (("refused", "connection refused"), ("timed out", "connect timed out"), ("no route", "no route to host"),
           ("unreachable", "network unreachable"), ("resolution", "name does not resolve"),
           ("reset", "connection reset"), ("socket closed", "connection closed"))


def summarize(e: errors.MeshnodeError, timeout: float) -> str:
    """A failed probe's cause in a few words (gRPC's own message runs to hundreds of characters). Pure."""
    if isinstance(e, errors.DeadlineError):
        return f"no answer within {timeout:g} s"
    if isinstance(e, errors.NotAMeshnodeError):
        return "answers, but not as a meshnode"
    low = e.message.lower()
    for needle, cause in _CAUSES:
        if needle in low:
            return cause
    return e.message[:ERROR_CHARS]


async def probe_once(aio: AioRun, endpoint: str, timeout: float, node_id: str | None = None,
                     plaintext: bool = False) -> Probe:
    """One bounded Health call; any failure is a failed Probe, never an exception.

    Over TLS pinned to ``node_id`` (an impostor on a registered node's endpoint fails the probe), or in
    plaintext for a node whose signed capability says it serves so (``--insecure``).
    """
    at, t0 = time.time(), time.perf_counter()
    try:
        with trio.fail_after(timeout + SLACK):
            reply = await aio(functools.partial(health, endpoint, timeout, node_id, plaintext=plaintext))
    except errors.MeshnodeError as e:
        return Probe(at, False, error=summarize(e, timeout), seconds=time.perf_counter() - t0)
    except trio.TooSlowError:
        return Probe(at, False, error=f"no answer within {timeout + SLACK:g} s", seconds=time.perf_counter() - t0)
    except Exception as e:  # an endpoint is the node's claim: whatever it makes grpc raise, keep probing others
        log.warning("probe of %s failed unexpectedly: %r", endpoint, e)
        return Probe(at, False, error=repr(e)[:ERROR_CHARS], seconds=time.perf_counter() - t0)
    return Probe(at, True, health=reply, seconds=time.perf_counter() - t0)


def again(state: ProbeState, fail_limit: int, retry: float) -> bool:
    """Probe once more, ``retry`` seconds on, before the next round: the node answered before, its last probe
    failed, and it is not dead yet (a failure confirmed at once, or cleared at once). Pure."""
    return retry > 0 and state.last_ok is not None and 0 < state.failures < fail_limit


async def _probe(registry: Registry, target: Target, aio: AioRun, config: ProbeConfig, busy: set[str],
                 plaintext: bool) -> None:
    book = registry.probes
    try:
        while True:
            probe = await probe_once(aio, target.endpoint, config.timeout, target.node_id, plaintext)
            book.record(target.node_id, target.endpoint, probe)
            if probe.ok and probe.health is not None:  # a sample for the charts (meshnode/web/mapseries.py)
                registry.series.add(target.node_id, probe.at, probe.health.tokens_total, probed=True)
            state = book.states[target.node_id]
            if not probe.ok and state.failures == book.fail_limit:
                log.info("node %s at %s stopped answering: %s", target.node_id[:12], target.endpoint, probe.error)
            if not again(state, book.fail_limit, config.retry):
                return
            await trio.sleep(config.retry)  # still busy: no round probes it meanwhile
    finally:
        busy.discard(target.node_id)


def start_round(nursery: trio.Nursery, registry: Registry, aio: AioRun, busy: set[str], config: ProbeConfig) -> int:
    """Start this round's probes in ``nursery``; returns how many were started."""
    entries = registry.live(time.time())
    registry.probes.keep(e.node_id for e in entries)
    registry.series.keep(e.node_id for e in entries)
    room = max(0, config.max_in_flight - len(busy))
    candidates = [(e.node_id, e.advert.capability.endpoints[0]) for e in entries if e.advert.capability.endpoints]
    targets = pick(candidates, registry.probes.states, busy, min(config.max_per_round, room))
    plain = {e.node_id for e in entries if e.advert.capability.insecure}
    for t in targets:
        busy.add(t.node_id)
        nursery.start_soon(_probe, registry, t, aio, config, busy, t.node_id in plain)
    return len(targets)


async def run_prober(registry: Registry, *, every: float = 2.0, config: ProbeConfig | None = None,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Probe the registry's nodes until cancelled (``config`` overrides ``every``)."""
    config = config or ProbeConfig(every=every)
    busy: set[str] = set()
    async with open_aio_thread("meshnode-tracker-probe") as aio, trio.open_nursery() as nursery:
        task_status.started()
        while True:
            deadline = trio.current_time() + config.every
            start_round(nursery, registry, aio.run, busy, config)
            await trio.sleep_until(deadline)
