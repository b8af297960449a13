"""A hop that lies is caught (docs/security.md, "A hop that lies").

The liar is a real node process whose test-only fault hook (``MESHNODE_TEST_LIE_EVERY``) nudges one
value of the residual it sends on by one ulp in one step of 50, and seals what it sent. The initiator
is ``meshnode generate`` at its default audit settings: a node on probation is audited every session,
every ``--audit-every`` (16) steps, by a replica of its range.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import trio

from meshnode.audit.policy import AuditPolicy, Ledger
from meshnode.proto import node_pb2 as pb
from tests.conftest import PROMPT, initiator, llama_reference

N_TOKENS = 120
LIE_EVERY = 50
EVERY = AuditPolicy().every  # the default


async def _start(node_factory, layers: str, *, lie: bool = False):
    prefix = ("env", f"MESHNODE_TEST_LIE_EVERY={LIE_EVERY}") if lie else ()
    return await trio.to_thread.run_sync(lambda: node_factory(layers, prefix=prefix))


async def _generate(cmd: list[str]) -> tuple[list[dict], str]:
    lines: list[dict] = []
    async with initiator(cmd, timeout=300, on_line=lambda b: lines.append(json.loads(b))) as run:
        pass
    assert run.proc.returncode == 0, run.text()
    return lines, run.text()


async def test_a_hop_that_lies_by_one_ulp_is_caught_rolled_back_and_routed_around(model, node_factory):
    reference = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, N_TOKENS))
    head = await _start(node_factory, "0:10")
    liar = await _start(node_factory, "10:20", lie=True)
    tail = await _start(node_factory, "20:30")
    replica = await _start(node_factory, "10:20")
    cmd = [sys.executable, "-m", "meshnode", "generate", "--peer", head.endpoint, "--peer", liar.endpoint,
           "--peer", tail.endpoint, "--spare", replica.endpoint, "--prompt", PROMPT,
           "--max-tokens", str(N_TOKENS), "--stream", "--json"]
    lines, err = await _generate(cmd)
    *streamed, result = lines
    assert result["tokens"] == reference.tokens, err  # the text equals the honest run's
    assert [s["token"] for s in streamed] == reference.tokens  # nothing unchecked was streamed, then taken back
    audit = result["audit"]
    assert audit["audited"] and audit["every"] == EVERY
    assert audit["hops"][liar.endpoint] == replica.endpoint
    (caught,) = audit["caught"]
    # the liar's 50th computed step: the prompt's chunk was its first, then one step per token
    lie_at = len(reference.prompt_tokens) + LIE_EVERY - 2
    assert (caught["hop"], caught["layers"], caught["position"]) == (liar.endpoint, "10:20", lie_at), err
    assert 0 < caught["noticed_at_position"] - lie_at <= EVERY  # caught within --audit-every steps of the lie
    (f,) = result["failovers"]
    assert f["hop"] == liar.endpoint
    assert f["replacement"] == [replica.endpoint]
    assert "HOP_MISBEHAVED" in f["error"]
    assert f["replayed_positions"] >= lie_at  # the replica rebuilt the range's KV up to the lie, then on
    assert result["route"] == [head.endpoint, replica.endpoint, tail.endpoint]
    # the evidence is kept, signed by the initiator: the liar's seals and inputs up to the wrong chunk
    env = pb.SignedEnvelope.FromString(Path(caught["evidence"]).read_bytes())
    ev = pb.Evidence.FromString(env.payload)
    assert ev.accused_node_id == caught["node_id"]
    assert ev.wrong_pos_start == lie_at
    assert [s.activation.pos_start for s in ev.steps][-1] == lie_at
    assert all(s.HasField("sender_seal") for s in ev.steps)  # each input as its sender (the head) sealed it


async def test_an_honest_route_is_audited_on_probation_and_then_at_the_rate(model, node_factory, tmp_path):
    reference = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, 24))
    head = await _start(node_factory, "0:15")
    tail = await _start(node_factory, "15:30")
    spare_head = await _start(node_factory, "0:15")
    spare_tail = await _start(node_factory, "15:30")
    base = [sys.executable, "-m", "meshnode", "generate", "--peer", head.endpoint, "--peer", tail.endpoint,
            "--spare", spare_head.endpoint, "--spare", spare_tail.endpoint, "--prompt", PROMPT,
            "--max-tokens", "24", "--json"]
    (result,), err = await _generate([*base, "--audit-probation", "1", "--audit-rate", "0"])
    assert result["tokens"] == reference.tokens, err
    audit = result["audit"]
    assert audit["audited"] and audit["caught"] == [], err
    assert audit["hops"] == {head.endpoint: spare_head.endpoint, tail.endpoint: spare_tail.endpoint}
    assert audit["checked_positions"] == len(reference.prompt_tokens) + 24 - 1  # every step, to the last
    assert result["failovers"] == []
    # both passed their one probation session: at rate 0 the next session is not audited
    (again,), err = await _generate([*base, "--audit-probation", "1", "--audit-rate", "0"])
    assert again["audit"] == {"audited": False}, err
    assert again["tokens"] == reference.tokens


def test_the_ledger_audits_nodes_on_probation_then_at_the_rate(tmp_path):
    policy = AuditPolicy(rate=0.25, probation=2)
    ledger = Ledger(tmp_path)
    rng = random.Random(7)
    assert ledger.audited(["a", "b"], policy, rng)
    ledger.passed(["a", "b"])
    assert ledger.audited(["a", "b"], policy, rng)  # one clean session of two
    ledger.passed(["a", "b"])
    assert Ledger(tmp_path).clean == {"a": 2, "b": 2}  # kept in the state dir
    draws = [Ledger(tmp_path).audited(["a", "b"], policy, rng) for _ in range(4000)]
    assert 0.2 < sum(draws) / len(draws) < 0.3  # past probation: about a quarter
    assert Ledger(tmp_path).audited(["a", "new"], policy, rng)  # a newcomer on the route: always
    (tmp_path / "audits.json").write_text("{not json")
    assert Ledger(tmp_path).clean == {}  # unreadable: everyone back on probation (logged), never a crash
    assert not Ledger(tmp_path).audited(["a"], AuditPolicy(rate=0.0, probation=0), rng)
