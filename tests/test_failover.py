"""A hop SIGKILLed mid-generation with a spare for its span: the initiator re-routes that span only,
replays the session there, and the text equals the uninterrupted whole-model output.

The initiator is its own process (``meshnode generate --spare ... --stream --json``), as users run it;
the test kills the hop after the first streamed tokens, so the kill lands mid-generation.
"""

from __future__ import annotations

import functools
import json
import signal
import sys

import pytest
import trio

from meshnode import errors
from meshnode.routing.choose import Candidate
from meshnode.routing.failover import Backoff, can_fail_over, replacement, replay_depths, spare_candidates
from tests.conftest import PROMPT, initiator, llama_reference

N_TOKENS = 48
KILL_AFTER = 4
ROUTE = ("0:7", "7:19", "19:30")


def _cand(ep: str, a: int, b: int) -> Candidate:
    return Candidate(ep, ep, a, b, 10.0, 0.0, 1)


def test_replacement_covers_exactly_the_failed_span_and_avoids_backed_off_peers() -> None:
    spares = [_cand("a", 7, 19), _cand("b", 7, 12), _cand("c", 12, 19), _cand("d", 0, 19)]
    assert [c.endpoint for c in replacement((7, 19), spares, frozenset())] == ["a"]
    assert [c.endpoint for c in replacement((7, 19), spares, frozenset({"a"}))] == ["b", "c"]
    with pytest.raises(errors.RouteError, match="no other peer can take over layers 7:19"):
        replacement((7, 19), spares, frozenset({"a", "c"}))


def test_spares_are_the_known_peers_off_the_route() -> None:
    known = [_cand("t2", 15, 30), _cand("h", 0, 15), _cand("t", 15, 30), _cand("h2", 0, 15)]
    assert [c.endpoint for c in spare_candidates(known, ["h", "t"])] == ["h2", "t2"]
    # after t2 took over from t, t (it may come back) is a spare and t2 is not
    assert [c.endpoint for c in spare_candidates(known, ["h", "t2"])] == ["h2", "t"]


def test_a_replay_reaches_only_as_far_as_the_last_hop_lacking_its_positions() -> None:
    chunks = [5, 1, 1, 1]  # a 5-token prompt, then three decode steps: positions 0..7
    assert replay_depths(chunks, [0, 8, 8]) == [1, 1, 1, 1]  # a new head: no hop after it lacks anything
    assert replay_depths(chunks, [8, 8, 0]) == [3, 3, 3, 3]  # a new tail: every chunk goes all the way
    assert replay_depths(chunks, [8, 6, 8]) == [0, 0, 2, 2]  # a middle behind by two positions
    assert replay_depths(chunks, [8, 8, 8]) == [0, 0, 0, 0]  # nothing to replay


def test_backoff_grows_and_expires() -> None:
    b = Backoff(base=1.0, cap=5.0)
    assert b.fail("x", 100.0) == 101.0
    assert b.fail("x", 100.0) == 102.0
    assert b.fail("x", 100.0) == 104.0
    assert b.fail("x", 100.0) == 105.0  # capped
    assert b.avoided(104.5) == frozenset({"x"})
    assert b.avoided(105.0) == frozenset()
    b.succeed("x")
    assert b.fail("x", 0.0) == 1.0


def test_only_peer_failures_of_the_route_fail_over() -> None:
    route = ["h:1", "t:2"]
    assert can_fail_over(errors.PeerError("gone", hop="t:2"), route)
    assert can_fail_over(errors.DeadlineError("slow", hop="h:1"), route)
    assert not can_fail_over(errors.PeerError("gone", hop="elsewhere:3"), route)
    assert not can_fail_over(errors.FingerprintMismatchError("other model", hop="t:2"), route)
    assert not can_fail_over(errors.InputError("bad flag"), route)


@pytest.fixture(scope="module")
def reference48(model):
    return llama_reference(model, PROMPT, N_TOKENS)


async def _generate_and_kill(cmd: list[str], victim) -> tuple[list[dict], str]:
    """Run the initiator; SIGKILL ``victim`` once KILL_AFTER tokens have streamed. Returns (JSON lines, stderr)."""
    lines: list[dict] = []

    def on_line(line: bytes) -> None:
        lines.append(json.loads(line))
        if len(lines) == KILL_AFTER:
            victim.proc.send_signal(signal.SIGKILL)

    async with initiator(cmd, timeout=120, on_line=on_line) as run:
        pass
    assert run.proc.returncode == 0, run.text()
    return lines, run.text()


@pytest.mark.parametrize(("victim", "spare_layers"), [
    (0, ["0:7"]),             # the head
    (1, ["7:19"]),            # a middle
    (2, ["19:30"]),           # the tail
    (1, ["7:12", "12:19"]),   # a middle, its span taken over by two spares
])
async def test_killed_hop_is_replaced_and_the_text_is_unchanged(node_factory, reference48, victim, spare_layers):
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ROUTE]
    spares = [await trio.to_thread.run_sync(node_factory, layers) for layers in spare_layers]
    cmd = [sys.executable, "-m", "meshnode", "generate", *[a for n in nodes for a in ("--peer", n.endpoint)],
           *[a for s in spares for a in ("--spare", s.endpoint)], "--prompt", PROMPT,
           "--max-tokens", str(N_TOKENS), "--stream", "--json"]
    lines, err = await _generate_and_kill(cmd, nodes[victim])
    *streamed, result = lines
    assert result["tokens"] == reference48.tokens, err  # bit-exact continuation: the same greedy tokens
    assert [s["token"] for s in streamed] == reference48.tokens[: len(streamed)]
    (f,) = result["failovers"]  # the kill landed mid-generation and was survived once
    assert f["hop"] == nodes[victim].endpoint
    assert f["layers"] == ROUTE[victim]
    assert f["replacement"] == [s.endpoint for s in spares]
    assert "PEER_UNAVAILABLE" in f["error"]
    assert f["replayed_positions"] >= len(reference48.prompt_tokens) + KILL_AFTER - 1
    assert f["seconds_to_next_token"] is not None
    expected = [n.endpoint for i, n in enumerate(nodes) if i != victim]
    expected[victim:victim] = [s.endpoint for s in spares]
    assert result["route"] == expected


@pytest.mark.parametrize("victim", [0, 1])
async def test_a_restarted_hop_without_spare_gets_the_session_back_by_replay(model, node_factory, reference48,
                                                                            tmp_path, victim):
    """No spare: the initiator waits for the killed hop to come back (a systemd restart: same port, same
    identity); the restarted node holds no KV state, so the replay rebuilds it and the text is unchanged."""
    state = tmp_path / "state"
    state.mkdir()
    cuts = ("0:15", "15:30")
    nodes = [await trio.to_thread.run_sync(functools.partial(node_factory, layers, **(
        {"extra": ("--state-dir", str(state))} if i == victim else {}))) for i, layers in enumerate(cuts)]
    port = nodes[victim].endpoint.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "meshnode", "generate", *[a for n in nodes for a in ("--peer", n.endpoint)],
           "--prompt", PROMPT, "--max-tokens", str(N_TOKENS), "--rejoin-wait", "60", "--stream", "--json"]

    async def restart() -> None:
        await trio.to_thread.run_sync(nodes[victim].proc.wait)
        await trio.to_thread.run_sync(functools.partial(
            node_factory, cuts[victim], extra=("--state-dir", str(state), "--listen", f"127.0.0.1:{port}")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(restart)
        lines, err = await _generate_and_kill(cmd, nodes[victim])
    result = lines[-1]
    assert result["tokens"] == reference48.tokens, err
    (f,) = result["failovers"]
    assert f["hop"] == nodes[victim].endpoint
    assert f["replacement"] == [nodes[victim].endpoint]  # the same peer, back again
    assert f["replayed_positions"] >= len(reference48.prompt_tokens) + KILL_AFTER - 1
