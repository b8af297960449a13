"""session/profile.py: a decoded token's time per hop, from the steps' timings (pure)."""

from meshnode.session.profile import RouteClock


def test_each_hop_gets_its_compute_its_own_handling_and_the_initiator_the_rest() -> None:
    c = RouteClock()
    for _ in range(4):  # head computes 10 ms, tail 12; the tail answers in 13, the head in 26
        c.add([("head", 10_000_000, 26_000_000), ("tail", 12_000_000, 13_000_000)])
    t = c.table(decode_seconds=4 * 0.030)
    assert t["tokens"] == 4
    head, tail = t["per_hop"]
    assert (head["compute_ms"], head["handle_ms"], head["own_ms"]) == (10.0, 26.0, 3.0)
    assert (tail["compute_ms"], tail["handle_ms"], tail["own_ms"]) == (12.0, 13.0, 1.0)
    assert t["wall_ms"] == 30.0
    assert t["initiator_ms"] == 4.0
    assert t["compute_share"] == round(22 / 30, 3)


def test_a_draft_step_counts_every_token_it_yielded() -> None:
    c = RouteClock()
    c.add([("head", 8_000_000, 20_000_000), ("tail", 10_000_000, 11_000_000)], tokens=4)
    t = c.table()
    assert t["tokens"] == 4
    assert t["per_hop"][0]["compute_ms"] == 2.0
    assert "wall_ms" not in t


def test_a_failover_restarts_the_clock_on_the_new_route() -> None:
    c = RouteClock()
    c.add([("head", 1, 2), ("tail", 1, 1)])
    c.add([("head", 5_000_000, 9_000_000), ("spare", 3_000_000, 3_000_000)])
    t = c.table()
    assert t["tokens"] == 1
    assert [h["endpoint"] for h in t["per_hop"]] == ["head", "spare"]
    assert t["per_hop"][0]["own_ms"] == 1.0
