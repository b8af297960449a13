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
import time

import pytest
import trio

from meshnode.audit.policy import AuditPolicy, Ledger
from meshnode.discovery.tracker_client import lookup
from meshnode.proto import node_pb2 as pb
from tests.conftest import PROMPT, aio, initiator, llama_reference
from tests.test_tracker import _get, _stop
from tests.test_tracker_evidence import _start as _start_tracker_with

N_TOKENS = 120
LIE_EVERY = 50
EVERY = AuditPolicy().every  # the default


async def _start(node_factory, layers: str, *, lie: bool = False, tracker: str | None = None):
    prefix = ("env", f"MESHNODE_TEST_LIE_EVERY={LIE_EVERY}") if lie else ()
    extra = ("--tracker", tracker) if tracker else ()
    return await trio.to_thread.run_sync(lambda: node_factory(layers, prefix=prefix, extra=extra))


async def _generate(cmd: list[str]) -> tuple[list[dict], str]:
    lines: list[dict] = []
    async with initiator(cmd, timeout=300, on_line=lambda b: lines.append(json.loads(b))) as run:
        pass
    assert run.proc.returncode == 0, run.text()
    return lines, run.text()


@pytest.fixture
def verifying_tracker(tmp_path, model):
    """A tracker that recomputes evidence with the model (``--verify-model``)."""
    proc, url = _start_tracker_with(tmp_path / "tracker.sqlite", "--verify-model", str(model))
    yield url
    _stop(proc)


async def test_a_hop_that_lies_by_one_ulp_is_caught_rolled_back_and_routed_around(model, node_factory,
                                                                                 verifying_tracker):
    url = verifying_tracker
    reference = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, N_TOKENS))
    head, liar, tail, replica = [await _start(node_factory, layers, lie=lie, tracker=url) for layers, lie in
                                 (("0:10", False), ("10:20", True), ("20:30", False), ("10:20", False))]
    cmd = [sys.executable, "-m", "meshnode", "generate", "--peer", head.endpoint, "--peer", liar.endpoint,
           "--peer", tail.endpoint, "--spare", replica.endpoint, "--prompt", PROMPT,
           "--max-tokens", str(N_TOKENS), "--stream", "--json", "--tracker", url]
    lines, err = await _generate(cmd)
    *streamed, result = lines
    assert result["tokens"] == reference.tokens, err  # the text equals the honest run's
    assert [s["token"] for s in streamed] == reference.tokens  # nothing unchecked was streamed, then taken back
    audit = result["audit"]
    assert audit["audited"]
    assert audit["every"] == EVERY
    assert audit["hops"][liar.endpoint] == replica.endpoint
    (caught,) = audit["caught"]
    # the liar's 50th computed step: the prompt's chunk was its first, then one step per token
    lie_at = len(reference.prompt_tokens) + LIE_EVERY - 2
    assert (caught["hop"], caught["layers"], caught["position"]) == (liar.endpoint, "10:20", lie_at), err
    assert 0 < caught["noticed_at_position"] - lie_at <= EVERY  # the check covering the lie: within 16 steps
    assert caught["route_at_position"] - lie_at <= 2 * EVERY  # checks run beside the route, at most two behind
    (f,) = result["failovers"]
    assert f["hop"] == liar.endpoint
    assert f["replacement"] == [replica.endpoint]
    assert "HOP_MISBEHAVED" in f["error"]
    assert f["replayed_positions"] >= lie_at  # the replica rebuilt the range's KV up to the lie, then on
    assert result["route"] == [head.endpoint, replica.endpoint, tail.endpoint]
    # the evidence is kept, signed by the initiator: the liar's seals and inputs up to the wrong chunk
    env = pb.SignedEnvelope.FromString(await trio.Path(caught["evidence"]).read_bytes())
    ev = pb.Evidence.FromString(env.payload)
    assert ev.accused_node_id == caught["node_id"]
    assert ev.wrong_pos_start == lie_at
    assert [s.activation.pos_start for s in ev.steps][-1] == lie_at
    assert all(s.HasField("sender_seal") for s in ev.steps)  # each input as its sender (the head) sealed it
    # anyone with the model can check it
    check = await trio.run_process([sys.executable, "-m", "meshnode", "verify-evidence", caught["evidence"],
                                    "--model", str(model), "--json"], capture_stdout=True, check=False)
    assert check.returncode == 0, check.stdout  # the lie confirmed
    assert json.loads(check.stdout)["pos_start"] == lie_at
    # the tracker recomputed the evidence with its own copy of the model and marked the liar, for good
    status = _get(url + "/api/status")
    by_id = {n["node_id"]: n for n in status["nodes"]}
    assert by_id[caught["node_id"]]["misbehaving"] is True, err
    assert by_id[caught["node_id"]]["misbehaving_report"]["pos_start"] == lie_at
    assert [n for n in by_id.values() if n["misbehaving"]] == [by_id[caught["node_id"]]]
    found = await lookup(url, ev.model_fingerprint[:12])
    assert caught["node_id"] not in {p.node_id for p in found}  # clients route around it
    assert len(found) == 3


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
    assert audit["audited"], err
    assert audit["caught"] == [], err
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


async def _hostile_outputs_and_audit_opens(head: str, tail: str) -> dict[str, object]:
    from meshnode import errors
    from meshnode.audit.auditor import Shadow
    from meshnode.identity import NodeIdentity
    from meshnode.identity.routeauth import HopPlan, sign_control, sign_route
    from meshnode.session.initiator import GenerateConfig, RouteSession, check_route
    from meshnode.transport.client import outputs
    from tests.test_route_auth import _code, _try_open

    out: dict[str, object] = {}
    caps = await check_route([head, tail])
    me, stranger = NodeIdentity.generate(), NodeIdentity.generate()
    rs = RouteSession([head, tail], caps, GenerateConfig(prompt=""), me)
    await rs.open()
    try:
        await rs.step([1, 2, 3, 4], sample=True)
        await rs.step([5], sample=True)
        now = int(time.time())
        mine = await outputs(head, caps[0].node_id, rs.id, sign_control(me, rs.id, "outputs", now=now), 0, 0)
        out["mine"] = [(b.pos_start, list(b.shape)) for b in mine]
        for name, auth, sid in (("stranger", sign_control(stranger, rs.id, "outputs", now=now), rs.id),
                                ("release order", sign_control(me, rs.id, "release", now=now), rs.id),
                                ("unknown", sign_control(me, "nope", "outputs", now=now), "nope")):
            try:
                await outputs(head, caps[0].node_id, sid, auth, 0, 0)
                out[name] = "served"
            except errors.MeshnodeError as e:
                out[name] = str(e)
    finally:
        await rs.release()
    # an audit open naming a downstream hop is refused; a plain audit session answers with seals
    cap = caps[0]
    plan = HopPlan(cap.node_id, cap.attestation.signer_public_key, cap.range.start, cap.range.end)
    sid = "audit-with-downstream"
    (signed,) = sign_route(me, session_id=sid, epoch=1, fingerprint=cap.model_fingerprint, hops=[plan],
                           now=int(time.time()), audit=True)
    frame = pb.SessionFrame(route_session_id=sid, route_epoch=1, open=pb.SessionOpen(
        schema_version=1, route_session_id=sid, route_epoch=1, model_fingerprint=cap.model_fingerprint,
        range=cap.range, numerics=cap.numerics, limits=cap.limits, signed_open=signed,
        downstream=[pb.Hop(endpoint=tail, range=caps[1].range, node_id=caps[1].node_id)]))
    out["audit with downstream"] = _code(await _try_open(head, frame))
    digests = []
    for _ in range(2):  # two audit sessions of the same input: bit-identical seals
        sh = Shadow(cap.node_id, head, cap)
        await sh.open(me, pb.DTYPE_F32, 30.0)
        try:
            digests.append([(await sh.run(0, [1, 2, 3, 4], 30.0)).output_sha256,
                            (await sh.run(4, [5], 30.0)).output_sha256])
        finally:
            await sh.close()
    out["audit digests"] = digests
    return out


async def test_outputs_go_to_the_initiator_only_and_audit_sessions_forward_nothing(route2):
    head, tail = (n.endpoint for n in route2)
    out = await aio(_hostile_outputs_and_audit_opens, head, tail)
    assert out["mine"] == [(0, [4, 576]), (4, [1, 576])]  # the head's residuals per chunk, as sent on
    assert "NOT_FOUND" in str(out["stranger"])
    assert "UNKNOWN_SESSION" in str(out["stranger"])
    assert "PERMISSION_DENIED" in str(out["release order"])  # an order for another action
    assert "NOT_FOUND" in str(out["unknown"])
    assert out["audit with downstream"] == "ROUTE_INVALID"
    (a, b) = out["audit digests"]
    assert a == b
    assert all(len(d) == 32 for d in a)
    assert a[0] != a[1]


async def test_a_tail_that_returns_another_token_than_it_drew_is_caught(model, node_factory):
    """The seal names the token the tail returned; its replica draws with the same chain from the same
    logits: a tail that returns the next token id every 20th step is caught, and the text is the honest one."""
    reference = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, 48))
    head = await _start(node_factory, "0:15")
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", prefix=("env", "MESHNODE_TEST_LIE_EVERY=20")))
    replica = await _start(node_factory, "15:30")
    cmd = [sys.executable, "-m", "meshnode", "generate", "--peer", head.endpoint, "--peer", tail.endpoint,
           "--spare", replica.endpoint, "--prompt", PROMPT, "--max-tokens", "48", "--json"]
    (result,), err = await _generate(cmd)
    assert result["tokens"] == reference.tokens, err
    (caught,) = result["audit"]["caught"]
    assert caught["hop"] == tail.endpoint
    assert caught["drew"] == (caught["replica_drew"] + 1) % 49152
    assert caught["position"] == len(reference.prompt_tokens) + 20 - 2  # its 20th computed step
    assert "evidence" not in caught  # a draw is not recomputed by a verifier (yet): no evidence kept
    (f,) = result["failovers"]
    assert f["replacement"] == [replica.endpoint]
    assert result["route"] == [head.endpoint, replica.endpoint]


async def test_the_api_routes_around_a_liar_it_caught_and_its_map_marks_it(model, node_factory):
    """Through ``meshnode api``: the gateway's audit catches the liar mid-answer (the text still equals the
    honest run's), the API's mesh map marks it misbehaving with where it lied, and the next request's
    route leaves it out."""
    import httpx
    import llama_cpp

    from tests.test_chat_page import start_api

    def whole() -> str:
        llm = llama_cpp.Llama(str(model), verbose=False)  # the default context settings, as the route's
        try:
            return str(llm.create_completion(PROMPT, max_tokens=N_TOKENS, temperature=0)["choices"][0]["text"])
        finally:
            llm.close()

    reference = await trio.to_thread.run_sync(lambda: llama_reference(model, PROMPT, N_TOKENS))
    whole_text = await trio.to_thread.run_sync(whole)
    head, liar, tail, replica = [await _start(node_factory, layers, lie=lie) for layers, lie in
                                 (("0:10", False), ("10:20", True), ("20:30", False), ("10:20", False))]
    proc, url = await trio.to_thread.run_sync(
        lambda: start_api([head.endpoint, liar.endpoint, tail.endpoint, replica.endpoint]))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            answers: list[str] = []
            body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0}

            async def plain() -> None:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                answers.append(r.json()["choices"][0]["text"])

            for _ in range(3):
                # one answer streaming holds its route; the next request takes the other 10:20 node (the
                # gateway spreads its sessions by load): one of the two runs through the liar
                async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                    pieces: list[str] = []
                    async with trio.open_nursery() as nursery:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                doc = json.loads(line[6:])
                                pieces.append(doc["choices"][0]["text"] if doc["choices"] else "")
                                if len(pieces) == 1:
                                    nursery.start_soon(plain)
                    answers.append("".join(pieces))
                if any(n["misbehaving"] for n in (await client.get("/v1/mesh")).json()["nodes"]):
                    break
            assert set(answers) == {answers[0]}  # every answer the same text, the one with the lie caught too
            assert answers[0] == whole_text
            doc = (await client.get("/v1/mesh")).json()
            nodes = {n["endpoints"][0]: n for n in doc["nodes"]}
            assert nodes[liar.endpoint]["misbehaving"] is True
            report = nodes[liar.endpoint]["misbehaving_report"]
            assert report["range"] == [10, 20]
            assert report["pos_start"] == len(reference.prompt_tokens) + LIE_EVERY - 2
            assert [e for e, v in nodes.items() if v["misbehaving"]] == [liar.endpoint]
            (m,) = doc["models"]
            assert m["misbehaving"] == [nodes[liar.endpoint]["node_id"]]
            assert m["covered"] is True  # the replica serves 10:20
            after = await client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT,
                                                               "max_tokens": 8, "temperature": 0})
            assert liar.endpoint not in [h["endpoint"] for h in after.json()["meshnode"]["route"]]
            assert replica.endpoint in [h["endpoint"] for h in after.json()["meshnode"]["route"]]
    finally:
        proc.terminate()
        proc.wait(15)
        assert proc.stdout is not None
        proc.stdout.close()
