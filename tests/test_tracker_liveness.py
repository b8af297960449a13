"""The tracker's liveness: the pure verdict (exhaustively), target picking, and the prober over real gRPC."""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any

import pytest
import trio

from meshnode import errors
from meshnode.identity import NodeIdentity, tlscert
from meshnode.identity.advert import advertise, verify_advert
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.transport.aiothread import open_aio_thread
from meshnode.transport.server import serve_grpc
from tracker import views
from tracker.liveness import (
    FAIL_LIMIT,
    Probe,
    ProbeBook,
    ProbeState,
    Target,
    alive,
    freshest,
    judge,
    pick,
    probe_target,
    record,
)
from tracker.probe import ProbeConfig, run_prober, summarize
from tracker.registry import Entry, Registry

TTL = 30.0
FP = "ab" * 32


# -- the verdict, exhaustively ---------------------------------------------------------------


def _state(ever_ok: bool, failures: int, last_failed: float) -> ProbeState | None:
    """A state with ``failures`` failed probes, the last at ``last_failed`` (built through ``record``)."""
    s: ProbeState | None = None
    if ever_ok:
        s = record(s, "h:1", Probe(at=last_failed - 10, ok=True, health=pb.HealthReply()))
    for i in range(failures):
        s = record(s, "h:1", Probe(at=last_failed - (failures - 1 - i), ok=False, error="connection refused"))
    return s if s is not None else ProbeState("h:1")


@pytest.mark.parametrize(("ever_ok", "failures", "heartbeat_after", "expired", "limit"),
                         list(itertools.product([False, True], range(5), [False, True], [False, True], [1, 2, 3])))
def test_the_verdict_for_every_combination(ever_ok, failures, heartbeat_after, expired, limit):
    last_failed = 1000.0
    last_seen = last_failed + 0.5 if heartbeat_after else last_failed - 0.5
    now = last_seen + (TTL + 1 if expired else 1.0)
    v = judge(_state(ever_ok, failures, last_failed), last_seen, now, TTL, limit)
    # the rules of tracker/liveness.py, as a truth table
    if expired:
        dead, by = True, "heartbeat"
    elif not ever_ok:
        dead, by = False, "heartbeat"  # never reached by the tracker: heartbeats alone decide
    elif failures >= limit and not heartbeat_after:
        dead, by = True, "probe"
    else:
        dead, by = False, "probe"
    assert (v.alive, v.by) == (not dead, by)
    # the reason-less twin a lookup ranks thousands of entries with follows the same rules
    assert alive(_state(ever_ok, failures, last_failed), last_seen, now, TTL, limit) is (not dead)
    assert v.reason


def test_no_probe_yet_is_judged_by_heartbeats():
    assert judge(None, 100.0, 110.0, TTL).alive
    assert not judge(None, 100.0, 131.0, TTL).alive


def test_a_killed_node_dies_after_the_fail_limit_and_a_heartbeat_or_an_answer_revives_it():
    s = record(None, "h:1", Probe(at=0.0, ok=True, health=pb.HealthReply(tokens_total=5)))
    seen = -1.0  # its last heartbeat, before the probes
    assert judge(s, seen, 0.1, TTL).alive
    s = record(s, "h:1", Probe(at=2.0, ok=False, error="connection refused"))
    assert judge(s, seen, 2.1, TTL).alive  # one failure is not enough
    s = record(s, "h:1", Probe(at=4.0, ok=False, error="connection refused"))
    v = judge(s, seen, 4.1, TTL)
    assert (v.alive, v.by) == (False, "probe")
    assert "connection refused" in v.reason
    assert judge(s, 5.0, 5.1, TTL).alive  # a heartbeat after the last failed probe
    s = record(s, "h:1", Probe(at=6.0, ok=False, error="connection refused"))
    assert not judge(s, 5.0, 6.1, TTL).alive  # ... until the next probe fails
    s = record(s, "h:1", Probe(at=8.0, ok=True, health=pb.HealthReply()))
    assert judge(s, 5.0, 8.1, TTL).alive
    assert (s.failures, s.ok_total, s.failed_total) == (0, 2, 3)


def test_a_new_endpoint_starts_afresh():
    s = record(None, "h:1", Probe(at=0.0, ok=True, health=pb.HealthReply()))
    for t in (2.0, 4.0):
        s = record(s, "h:1", Probe(at=t, ok=False, error="x"))
    assert not judge(s, -1.0, 4.1, TTL).alive
    s = record(s, "h:2", Probe(at=6.0, ok=False, error="x"))  # the node re-registered elsewhere
    assert (s.endpoint, s.failures, s.last_ok) == ("h:2", 1, None)
    book = ProbeBook()
    book.record("n", "h:1", Probe(at=0.0, ok=True))
    assert book.get("n", "h:1") is not None
    assert book.get("n", "h:9") is None  # findings about another endpoint say nothing of this one
    book.keep([])
    assert book.get("n") is None


def test_the_freshest_counters_win():
    beat = pb.HealthReply(tokens_total=1)
    s = record(None, "h:1", Probe(at=20.0, ok=True, health=pb.HealthReply(tokens_total=9)))
    assert (freshest(beat, 10.0, s).source, freshest(beat, 10.0, s).health.tokens_total) == ("probe", 9)
    assert (freshest(beat, 30.0, s).source, freshest(beat, 30.0, s).health.tokens_total) == ("heartbeat", 1)
    assert freshest(beat, 10.0, None).source == "heartbeat"


@pytest.mark.parametrize(("endpoint", "ok"), [
    ("127.0.0.1:7001", True), ("[::1]:7001", True), ("node-3.lan:65535", True),
    ("unix:/run/x.sock", False), ("unix:///tmp/s", False), ("dns:///evil:80", False), ("ipv4:1.2.3.4:5", False),
    ("127.0.0.1:0", False), ("127.0.0.1:65536", False), ("127.0.0.1", False), (":7001", False), ("", False),
    ("a b:1", False), ("h:1/x", False), ("x" * 300 + ":1", False), ("h:1\n", False), ("[::1:7001", False),
])
def test_only_plain_host_port_endpoints_are_probed(endpoint, ok):
    assert (probe_target(endpoint) == endpoint) is ok


def test_pick_caps_dedupes_skips_busy_and_hostile_and_takes_the_least_recently_probed():
    states = {"a": record(None, "h:1", Probe(at=5.0, ok=True)), "b": record(None, "h:2", Probe(at=1.0, ok=True))}
    cands = [("a", "h:1"), ("b", "h:2"), ("c", "h:3"), ("d", "h:3"), ("e", "unix:/x"), ("f", "h:6")]
    assert pick(cands, states) == [Target("c", "h:3"), Target("f", "h:6"), Target("b", "h:2"), Target("a", "h:1")]
    assert pick(cands, states, cap=2) == [Target("c", "h:3"), Target("f", "h:6")]
    assert pick(cands, states, busy={"c", "f"}, cap=2) == [Target("d", "h:3"), Target("b", "h:2")]
    assert pick(cands, states, cap=0) == []


def test_a_failure_is_said_in_a_few_words():
    grpc_text = ("unreachable or not a gRPC server (failed to connect to all addresses; last error: UNKNOWN: "
                 "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused)")
    assert summarize(errors.PeerError(grpc_text), 1.5) == "connection refused"
    assert summarize(errors.DeadlineError("Health timed out"), 1.5) == "no answer within 1.5 s"
    assert summarize(errors.NotAMeshnodeError("UNIMPLEMENTED"), 1.5) == "answers, but not as a meshnode"
    assert summarize(errors.PeerError("odd"), 1.5) == "odd"


# -- views: dead nodes cover nothing, lookups leave them out -----------------------------------


def _entry(a: int, b: int, endpoint: str, now: float, health: pb.HealthReply | None = None,
           me: NodeIdentity | None = None) -> Entry:
    me = me or NodeIdentity.generate()
    cap = pb.Capability(node_id=me.node_id, model_fingerprint=FP, model_name="m", n_layer=30,
                        range=pb.LayerRange(start=a, end=b), range_digest="cd" * 32, endpoints=[endpoint],
                        attestation=attest(me, fingerprint=FP, start=a, end=b, range_digest="cd" * 32,
                                           llama_build="x", now=int(now)))
    env = advertise(me, cap, health or pb.HealthReply(), seq=1, now=int(now))
    return Entry(me.node_id, env, verify_advert(env, now=int(now), last_seq=None), now, now)


def test_a_dead_node_leaves_the_coverage_and_the_lookups():
    now = time.time()
    head = _entry(0, 15, "127.0.0.1:1", now, pb.HealthReply(live_sessions=1))
    tail = _entry(15, 30, "127.0.0.1:2", now, pb.HealthReply(live_sessions=1))
    ok = record(None, "127.0.0.1:2", Probe(at=now + 1, ok=True, health=pb.HealthReply(live_sessions=1)))
    alive = [views.node_view(head, now + 2, TTL), views.node_view(tail, now + 2, TTL, ok)]
    (m,) = views.status(alive)["models"]
    assert (m["covered"], m["gaps"], m["dead"], m["active_sessions"]) == (True, [], [], 1)
    dead = ok
    for t in (now + 3, now + 5):
        dead = record(dead, "127.0.0.1:2", Probe(at=t, ok=False, error="connection refused"))
    shown = [views.node_view(head, now + 6, TTL), views.node_view(tail, now + 6, TTL, dead)]
    assert [(v["alive"], v["liveness"]) for v in shown] == [(True, "alive"), (False, "dead")]
    (m,) = views.status(shown)["models"]
    assert (m["covered"], m["gaps"], m["dead"], m["nodes"]) == (False, [[15, 30]], [tail.node_id],
                                                                [head.node_id, tail.node_id])
    assert m["coverage"][14] == [head.node_id]
    assert m["coverage"][15] == []
    assert m["active_sessions"] == 0  # the dead tail's layers hold none: no session can run
    assert [v["node_id"] for v in views.lookup(shown, "m")["nodes"]] == [head.node_id]
    assert views.lookup(shown, "other")["nodes"] == []


def test_a_route_session_is_counted_once_not_once_per_hop():
    def n(a: int, b: int, live: int) -> dict[str, Any]:
        return {"range": [a, b], "live_sessions": live}

    assert views.route_sessions([n(0, 15, 1), n(15, 30, 1)], 30) == 1
    assert views.route_sessions([n(0, 15, 2), n(0, 15, 1), n(15, 30, 3)], 30) == 3  # replicas of the head
    assert views.route_sessions([n(0, 15, 1)], 30) == 0  # no route can run through a gap
    assert views.route_sessions([], 30) == 0


def test_a_claimed_layer_count_is_bounded():
    v = views.node_view(_entry(0, 15, "127.0.0.1:1", now := time.time()), now, TTL)
    v["n_layer"] = 2**32 - 1  # a node's claim: the coverage map must not become four billion lists
    (m,) = views.status([v])["models"]
    assert m["n_layer"] == views.MAX_LAYERS == len(m["coverage"])
    assert m["gaps"] == [[15, views.MAX_LAYERS]]


def test_gaps():
    assert views.gaps([["a"], [], [], ["b"], []]) == [[1, 3], [4, 5]]
    assert views.gaps([["a"]]) == []
    assert views.gaps([[], []]) == [[0, 2]]


# -- the prober over real gRPC -----------------------------------------------------------------


class _HealthOnly(pb_grpc.NodeServicer):
    """A gRPC server that answers Health only, counting calls (stands in for a node under the prober)."""

    def __init__(self) -> None:
        self.calls = 0

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthReply:
        self.calls += 1
        return pb.HealthReply(serving=True, tokens_total=self.calls)


async def test_the_prober_marks_a_stopped_server_dead_and_a_silent_one_stalls_nobody(tmp_path):
    silent = trio.socket.socket()  # accepts TCP (the kernel's backlog) but never speaks HTTP/2
    await silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    reg = Registry(tmp_path / "t.sqlite", ttl=TTL)
    fake = _HealthOnly()
    good_id = NodeIdentity.generate()  # the prober pins the TLS certificate to the advertised id
    async with open_aio_thread("test-node") as aio, trio.open_nursery() as nursery:
        server = trio.CancelScope()

        async def serve(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
            with server:
                await serve_grpc(fake, "127.0.0.1:0", aio=aio.run, tls=tlscert.make(good_id),
                                 task_status=task_status)

        good = await nursery.start(serve)
        now = time.time()
        entries = {name: _entry(0, 30, ep, now, me=good_id if name == "good" else None) for name, ep in
                   (("good", good), ("silent", f"127.0.0.1:{silent.getsockname()[1]}"), ("refused", refused),
                    ("hostile", "unix:/run/meshnode.sock"))}
        for e in entries.values():
            reg.register(e.envelope, e.advert, now)
        ids = {name: e.node_id for name, e in entries.items()}
        config = ProbeConfig(every=0.05, timeout=60.0)  # the silent node's probe outlasts the test
        await nursery.start(lambda task_status: run_prober(reg, config=config, task_status=task_status))

        def state(name: str) -> ProbeState | None:
            return reg.probes.get(ids[name])

        def probed() -> bool:
            good, refused = state("good"), state("refused")
            return good is not None and good.ok_total >= 5 and refused is not None and refused.failures >= 3

        def shown(name: str) -> dict[str, Any]:
            (v,) = [v for v in views.current(reg, time.time()) if v["node_id"] == ids[name]]
            return v

        with trio.fail_after(30):
            while not probed():  # noqa: ASYNC110 (the prober writes plain state: no event to wait on)
                await trio.sleep(0.05)
        # the silent node holds one probe, still unanswered, while the others were probed round after round
        assert state("silent") is None
        assert state("hostile") is None  # never probed: not a plain HOST:PORT
        assert shown("good")["counters_source"] == "probe"
        assert shown("good")["tokens_total"] >= 5
        assert shown("good")["alive"] is True
        assert shown("refused")["alive"] is True  # never reached by the tracker: judged by its heartbeats
        server.cancel()  # the node stops answering
        with trio.fail_after(30):
            while shown("good")["alive"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        v = shown("good")
        assert (v["liveness_by"], v["probe"]["failures"] >= FAIL_LIMIT) == ("probe", True)
        assert v["last_seen_seconds_ago"] < TTL  # dead by the probes, long before its TTL
        nursery.cancel_scope.cancel()
    silent.close()
    reg.close()
