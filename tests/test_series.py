"""The map's pure parts: tokens/s from counter samples (meshnode/web/mapseries.py), routes in use from the
heads' reports (meshnode/web/mapdoc.py, meshnode/session/inuse.py), hostile input bounded and typed."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from meshnode.api.mapview import ERROR_CHARS, FORGET_AFTER, MAX_KNOWN, Probed, own_reports, probed, remember, verdict
from meshnode.discovery.table import PeerEntry
from meshnode.proto import node_pb2 as pb
from meshnode.session.inuse import MAX_HOPS_IN_USE, MAX_ROUTES_IN_USE, is_head, routes_in_use
from meshnode.web import mapdoc, mapseries
from meshnode.web.mapdoc import MAX_ROUTES_READ, MAX_SESSIONS, Known
from meshnode.web.mapseries import Charted, SeriesBook, bucket_rates, grid, pair_rates, parse_window, total

# -- series -----------------------------------------------------------------------------


def test_a_steady_counter_is_its_rate_in_every_bucket():
    samples = [(float(t), 10 * t) for t in range(0, 101, 2)]  # 10 tokens/s, sampled every 2 s
    assert bucket_rates(samples, 100.0, 5.0, 20) == [10.0] * 20


def test_rates_are_time_weighted_and_unknown_parts_are_gaps():
    # 0..10 s: 0 tokens/s; 10..20 s: 30 tokens/s; a restart at 25 s (the counter drops); nothing after 30 s
    samples = [(0.0, 100), (10.0, 100), (20.0, 400), (25.0, 5), (30.0, 55)]
    assert pair_rates(samples) == [(0.0, 10.0, 0.0), (10.0, 20.0, 30.0), (20.0, 25.0, None), (25.0, 30.0, 10.0)]
    # buckets of 5 s from 0 to 40: the restart's interval has no rate; after the last sample, none
    assert bucket_rates(samples, 40.0, 5.0, 8) == [0.0, 0.0, 30.0, 30.0, None, 10.0, None, None]
    # a bucket straddling a change of rate is the time-weighted mean of both
    assert bucket_rates(samples, 15.0, 10.0, 1) == [15.0]
    # a bucket spanned by samples over less than half of it has no value
    assert bucket_rates([(0.0, 0), (2.0, 20)], 10.0, 10.0, 1) == [None]
    assert bucket_rates([(0.0, 0), (6.0, 60)], 10.0, 10.0, 1) == [10.0]


def test_samples_far_apart_say_nothing_of_the_time_between():
    samples = [(0.0, 0), (mapseries.MAX_GAP + 1, 1000)]
    assert pair_rates(samples) == [(0.0, mapseries.MAX_GAP + 1, None)]
    assert bucket_rates([], 100.0, 5.0, 3) == [None, None, None]
    assert bucket_rates([(50.0, 7)], 100.0, 5.0, 3) == [None, None, None]  # one sample: no rate yet


def test_a_models_rate_sums_its_tails_and_keeps_gaps():
    assert total([[1.0, None, None], [2.0, 3.0, None]], 3) == [3.0, 3.0, None]
    assert total([], 2) == [None, None]


def test_the_book_is_bounded_in_time_spacing_and_nodes():
    book = SeriesBook(window=60.0, spacing=1.5, max_nodes=3)
    assert book.add("a", 0.0, 0)
    assert not book.add("a", 1.0, 10)  # closer than the spacing: dropped
    assert not book.add("a", -5.0, 10)  # older than the last: dropped
    for t in range(2, 1000, 2):
        book.add("a", float(t), t)
    kept = book.samples("a")
    assert len(kept) <= math.ceil(60.0 / 1.5) + 2
    assert kept[-1] == (998.0, 998)
    assert kept[0][0] >= 998 - 60 - mapseries.MAX_GAP
    book.add("b", 0.0, 1)
    book.add("c", 0.0, 1, probed=True)
    assert not book.add("d", 0.0, 1)  # full: a node only heard of displaces nobody
    assert book.add("e", 5.0, 1, probed=True)  # a probed node displaces the one only heard of, updated longest ago
    assert set(book.tracks) == {"a", "c", "e"}  # b: last heard of at 0 s, a at 998 s
    book.add("f", 6.0, 1, probed=True)
    assert set(book.tracks) == {"c", "e", "f"}  # both heard-of-only series gave way
    assert not book.add("g", 7.0, 1, probed=True)  # every series probed: none gives way
    book.keep(["c"])
    assert set(book.tracks) == {"c"}
    assert book.add("h", 8.0, -5)  # a negative counter (impossible from a uint64) is kept as 0
    assert book.samples("h") == [(8.0, 0)]


def test_the_series_document_per_node_and_per_model():
    book = SeriesBook()
    for t in range(0, 61, 2):
        book.add("head", 1000.0 + t, 5 * t, probed=True)
        book.add("tail", 1000.0 + t, 5 * t, probed=True)
        book.add("tail2", 1000.0 + t, 2 * t, probed=True)
    nodes = [Charted("head", "fp", "m", False), Charted("tail", "fp", "m", True), Charted("tail2", "fp", "m", True)]
    doc = mapseries.series_doc(book, nodes, 1061.0, window=60.0, step=10.0)
    end, n = grid(1061.0, 60.0, 10.0)
    assert (end, n) == (1060.0, 6)
    assert doc["t"] == [1010.0, 1020.0, 1030.0, 1040.0, 1050.0, 1060.0]
    assert doc["nodes"]["head"][1:] == [5.0] * 5
    model = doc["models"]["fp"]
    assert model["tails"] == ["tail", "tail2"]  # the head is no tail: its positions pass through the tails too
    assert model["tokens_per_second"][1:] == [7.0] * 5
    assert doc["definition"] == mapseries.DEFINITION


@pytest.mark.parametrize(("window", "step", "want"), [
    (None, None, (900.0, 5.0)), ("", "", (900.0, 5.0)), ("120", "10", (120.0, 10.0)),
    ("1", "0.001", (60.0, 2.0)), ("1e9", "1e9", (900.0, 60.0)), ("-5", "-1", (60.0, 2.0)),
])
def test_window_and_step_are_clamped(window, step, want):
    assert parse_window(window, step) == want


@pytest.mark.parametrize(("window", "step"), [("nan", None), ("inf", None), (None, "abc"), ("1" * 40, None),
                                              (None, "-inf")])
def test_a_window_that_is_no_number_is_refused(window, step):
    with pytest.raises(ValueError):  # noqa: PT011 (the callers answer any ValueError with 400)
        parse_window(window, step)


# -- routes in use ------------------------------------------------------------------------

KNOWN = {"h": Known("fp", 0, 10), "m": Known("fp", 10, 20), "t": Known("fp", 20, 30), "t2": Known("fp", 20, 30),
         "x": Known("other", 0, 30), "h2": Known("fp", 0, 10)}


def _r(hops: list[str], sessions: int = 1) -> pb.RouteInUse:
    return pb.RouteInUse(hops=hops, sessions=sessions)


def test_a_head_reports_its_routes_busiest_first_and_bounded():
    assert routes_in_use([("a", "b"), ("a", "c"), ("a", "b")]) == [_r(["a", "b"], 2), _r(["a", "c"], 1)]
    many = [("a", f"n{i}") for i in range(100)]
    assert len(routes_in_use(many)) == MAX_ROUTES_IN_USE
    (long,) = routes_in_use([tuple(f"n{i}" for i in range(500))])
    assert len(long.hops) == MAX_HOPS_IN_USE
    assert routes_in_use([()]) == []
    assert is_head(pb.RouteOpen(initiator_node_id="i", prev_node_id="i"))
    assert not is_head(pb.RouteOpen(initiator_node_id="i", prev_node_id="h"))  # a later hop
    assert not is_head(pb.RouteOpen(initiator_node_id="i", prev_node_id="i", audit=True))  # an audit
    assert not is_head(pb.RouteOpen())


def test_valid_reports_become_routes_and_the_rest_is_dropped():
    reports = [("h", [_r(["h", "m", "t"], 2), _r(["h", "m", "t2"], 1)]),
               ("h2", [_r(["h2", "m", "t"], 5)])]
    assert mapdoc.routes(reports, KNOWN) == [
        {"model": "fp", "hops": ["h2", "m", "t"], "sessions": 5},
        {"model": "fp", "hops": ["h", "m", "t"], "sessions": 2},
        {"model": "fp", "hops": ["h", "m", "t2"], "sessions": 1}]


@pytest.mark.parametrize("entry", [
    _r(["m", "t"]),             # does not start at its reporter
    _r(["h", "nobody", "t"]),   # a node nobody knows
    _r(["h", "x"]),             # a node of another model
    _r(["h", "t"]),             # a hole in the layers (10..20)
    _r(["h", "m", "m", "t"]),   # a hop twice
    _r(["h", "m", "t"], 0),     # no session
    _r([]),                     # no hop
    _r(["h"] + ["m"] * 100),    # too long
])
def test_a_route_that_cannot_be_true_is_dropped(entry):
    assert mapdoc.routes([("h", [entry])], KNOWN) == []


def test_a_hostile_report_is_read_bounded():
    huge = [_r(["h", "m", "t"], 2**32 - 1)] + [_r(["h", f"junk{i}" * 50]) for i in range(10_000)]
    assert mapdoc.routes([("h", huge)], KNOWN) == [{"model": "fp", "hops": ["h", "m", "t"], "sessions": MAX_SESSIONS}]
    late = [_r(["h", "junk"])] * MAX_ROUTES_READ + [_r(["h", "m", "t"])]
    assert mapdoc.routes([("h", late)], KNOWN) == []  # only the first MAX_ROUTES_READ entries are read
    assert mapdoc.routes([("unknown", [_r(["unknown"])])], KNOWN) == []
    # a whole-model node alone is a route of one hop
    assert mapdoc.routes([("x", [_r(["x"], 3)])], KNOWN) == [{"model": "other", "hops": ["x"], "sessions": 3}]


def test_routes_seen_twice_keep_the_larger_count():
    a = [{"model": "fp", "hops": ["h", "m", "t"], "sessions": 1}]
    b = [{"model": "fp", "hops": ["h", "m", "t"], "sessions": 3}, {"model": "fp", "hops": ["h2", "m", "t"],
                                                                    "sessions": 2}]
    assert mapdoc.merge(a, b) == [{"model": "fp", "hops": ["h", "m", "t"], "sessions": 3},
                                  {"model": "fp", "hops": ["h2", "m", "t"], "sessions": 2}]


def test_models_cover_with_live_nodes_only():
    def n(nid: str, a: int, b: int, alive: bool = True, sessions: int = 0) -> dict:
        return {"node_id": nid, "model": "fp", "model_name": "m", "n_layer": 30, "range": [a, b], "alive": alive,
                "misbehaving": False, "live_sessions": sessions}

    (m,) = mapdoc.models([n("h", 0, 15, sessions=2), n("t", 15, 30, sessions=2), n("t2", 15, 30, alive=False)])
    assert (m["covered"], m["gaps"], m["dead"], m["active_sessions"]) == (True, [], ["t2"], 2)
    assert m["replicas"] == [1] * 30
    (m,) = mapdoc.models([n("h", 0, 15), n("t", 15, 30, alive=False)])
    assert (m["covered"], m["gaps"], m["dead_count"], m["node_count"]) == (False, [[15, 30]], 1, 2)
    assert m["nodes"] == ["h", "t"]  # live first


# -- the API's map: its own calls' verdicts, what it remembers -----------------------------


def _entry(nid: str, endpoint: str = "127.0.0.1:1") -> PeerEntry:
    cap = pb.Capability(node_id=nid, model_fingerprint="fp", model_name="m", n_layer=30,
                        range=pb.LayerRange(start=0, end=30))
    return PeerEntry(nid, endpoint, cap, "static", 0.0)


def test_the_apis_verdicts():
    assert verdict(False, Probed()) == (False, "dropped out of this gateway's table")
    failed = probed(probed(Probed(), 1.0, pb.HealthReply()), 3.0, None, "connection refused")
    assert (failed.failures, failed.last_ok, failed.error) == (1, 1.0, "connection refused")
    assert verdict(True, failed)[0] is True  # one failure: not dead yet
    dead = probed(failed, 5.0, None, "x" * 500)
    assert verdict(True, dead) == (False, "2 Health calls failed: " + "x" * ERROR_CHARS)
    assert verdict(True, probed(dead, 7.0, pb.HealthReply())) == (True, "answers Health")  # an answer resets it
    assert verdict(True, Probed())[0] is True  # in the table, not called yet


def test_the_api_remembers_dropped_nodes_for_a_while_and_a_bounded_number():
    known = remember({}, {"a": _entry("a"), "b": _entry("b")}, 100.0)
    known["a"] = replace(known["a"], probe=Probed(0, 99.0, pb.HealthReply(tokens_total=5)))
    later = remember(known, {"a": _entry("a")}, 110.0)  # b dropped out: still shown (dead) for a while
    assert set(later) == {"a", "b"}
    assert later["a"].probe.last_ok == 99.0  # what the calls found is kept
    assert later["b"].in_table_at == 100.0
    assert set(remember(later, {"a": _entry("a")}, 100.0 + FORGET_AFTER)) == {"a"}  # then forgotten
    moved = remember(later, {"a": _entry("a", "127.0.0.1:2")}, 111.0)
    assert moved["a"].probe == Probed()  # a new endpoint: called afresh
    flood = {f"n{i:04d}": _entry(f"n{i:04d}") for i in range(MAX_KNOWN + 50)}
    assert len(remember(later, flood, 120.0)) == MAX_KNOWN


def test_the_apis_own_sessions_are_reports_of_their_heads():
    by_endpoint = {"e1": "h", "e2": "t"}
    assert own_reports({("e1", "e2"): 2, ("e1", "gone"): 1}, by_endpoint) == [("h", [_r(["h", "t"], 2)])]
