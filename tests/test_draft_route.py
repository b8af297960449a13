"""Speculative decoding across real routes (issue 23, items 3 and 5): ``meshnode generate --draft ngram``
processes against nodes that are processes of their own.

The text with drafting is the text without it: greedy on 2 and 3 hops (equal to the whole model in
``Llama``), seeded sampling for several seeds and settings, through a hop SIGKILLed mid-generation with
a spare, and for 8 concurrent drafting sessions; drafts are rejected along the way (so every hop's KV
held exactly the accepted positions, or the later tokens would differ) and accepted often on a copy
task. No timing is asserted. Plus the hop's pure decisions (session/drafts.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from meshnode import errors
from meshnode.runtime.launch import local_route
from meshnode.session.drafts import check_draft, rollback_to, stands
from tests.conftest import cli, initiator, llama_reference

COPY = ("Copy this text exactly.\nText: The quick brown fox jumps over the lazy dog near the river bank, and the "
        "dog keeps sleeping in the warm afternoon sun.\nCopy: The quick brown fox")
N = 48


def _gen(peers: list[str], *extra: str, prompt: str = COPY, n: int = N) -> dict:
    done = cli("generate", *[a for p in peers for a in ("--peer", p)], "--prompt", prompt, "--max-tokens", str(n),
               "--json", *extra)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def copy_reference(model: Path):
    return llama_reference(model, COPY, N)


def test_pure_decisions() -> None:
    check_draft(4, 3, None, most=512)
    check_draft(4, 3, 4, most=512)
    for args, msg in (((3, 3, None), "carries 4 token ids"), ((4, 3, 2), "carries 2 residual rows"),
                      ((1, 0, None), "at least one"), ((9, 8, None), "exceeds")):
        with pytest.raises(errors.ShapeError, match=msg):
            check_draft(*args, most=8)
    assert stands(0, 7, [1, 7, 8], eog=False)
    assert not stands(0, 7, [1, 7, 8], eog=True)
    assert not stands(0, 6, [1, 7, 8], eog=False)
    assert not stands(2, 9, [1, 7, 8], eog=False)  # the last position: nothing after it to verify
    assert rollback_to(12, 15, 11)
    assert not rollback_to(10, 15, 11)  # below the draft: not a rollback a draft allows
    assert not rollback_to(12, 15, None)  # no draft step before it
    assert not rollback_to(15, 15, 11)


@pytest.mark.parametrize("hops", [2, 3])
def test_greedy_drafting_equals_the_whole_model(route2, route3, copy_reference, hops: int) -> None:
    peers = [n.endpoint for n in (route2 if hops == 2 else route3)]
    got = _gen(peers, "--draft", "ngram")
    assert got["prompt_tokens"] == copy_reference.prompt_tokens
    assert got["tokens"] == copy_reference.tokens
    d = got["draft"]
    assert d["accepted"] > 0  # the copy task drafts what the model writes
    assert d["drafted"] > d["accepted"]  # and some drafts were rejected: the KV was rolled back
    plain = _gen(peers)
    assert plain["draft"] == {}  # without --draft nothing is drafted
    # where each decoded token's time went, hop by hop in route order (session/profile.py)
    for run in (got, plain):
        prof = run["hops"]
        assert [h["endpoint"] for h in prof["per_hop"]] == peers
        assert prof["tokens"] == len(run["tokens"]) - 1
        assert all(h["compute_ms"] > 0 and h["handle_ms"] >= h["compute_ms"] for h in prof["per_hop"])
        assert 0 < prof["compute_share"] <= 1


@pytest.mark.parametrize("settings", [
    ("--temperature", "0.8", "--seed", "7"),
    ("--temperature", "0.8", "--seed", "1234", "--top-k", "20", "--repeat-penalty", "1.1"),
    ("--temperature", "1.2", "--seed", "99", "--top-p", "0.9", "--min-p", "0.05", "--presence-penalty", "0.3"),
])
def test_seeded_sampling_with_drafting_is_the_same_text(route2, settings) -> None:
    peers = [n.endpoint for n in route2]
    plain = _gen(peers, *settings)
    drafted = _gen(peers, *settings, "--draft", "ngram", "--draft-max", "6")
    assert drafted["tokens"] == plain["tokens"]
    assert drafted["text"] == plain["text"]
    assert drafted["draft"]["steps"] > 0


def test_a_long_generation_after_rejected_drafts_equals_the_whole_model(route2, model) -> None:
    prompt = "List the days of the week, then the months of the year:"
    ref = llama_reference(model, prompt, 96)
    got = _gen([n.endpoint for n in route2], "--draft", "ngram", prompt=prompt, n=96)
    assert got["tokens"] == ref.tokens
    assert got["draft"]["drafted"] > got["draft"]["accepted"]


def test_bad_draft_flags_are_refused() -> None:
    done = cli("generate", "--peer", "127.0.0.1:1", "--prompt", "x", "--draft", "magic")
    assert done.returncode != 0
    assert "invalid choice" in done.stderr
    done = cli("generate", "--peer", "127.0.0.1:1", "--prompt", "x", "--draft", "ngram", "--draft-max", "0")
    assert done.returncode != 0
    assert "--draft-max must be from 1 to 64" in done.stderr


async def test_a_hop_killed_mid_draft_with_a_spare_keeps_the_text(node_factory, copy_reference) -> None:
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ("0:15", "15:30")]
    spare = await trio.to_thread.run_sync(node_factory, "15:30")
    cmd = [sys.executable, "-m", "meshnode", "generate", *[a for n in nodes for a in ("--peer", n.endpoint)],
           "--spare", spare.endpoint, "--prompt", COPY, "--max-tokens", str(N), "--stream", "--json",
           "--draft", "ngram", "--audit-probation", "0", "--audit-rate", "0"]
    lines: list[dict] = []

    def on_line(line: bytes) -> None:
        lines.append(json.loads(line))
        if len(lines) == 6:
            nodes[1].proc.send_signal(signal.SIGKILL)

    async with initiator(cmd, timeout=120, on_line=on_line) as run:
        pass
    assert run.proc.returncode == 0, run.text()
    *streamed, result = lines
    assert result["tokens"] == copy_reference.tokens, run.text()
    assert [s["token"] for s in streamed] == copy_reference.tokens[: len(streamed)]
    (f,) = result["failovers"]
    assert f["hop"] == nodes[1].endpoint
    assert f["replacement"] == [spare.endpoint]
    assert result["draft"]["accepted"] > 0


def test_eight_concurrent_drafting_sessions(model: Path) -> None:
    prompts = [COPY.replace("fox", animal) for animal in ("fox", "cat", "owl", "wolf", "bear", "deer", "hare", "lynx")]
    refs = [llama_reference(model, p, 32, via_generate=False) for p in prompts]
    with local_route(model, ["0:15", "15:30"], extra=["--max-sessions", "8"]) as nodes:
        peers = [a for n in nodes for a in ("--peer", n.endpoint)]
        procs = [subprocess.Popen([sys.executable, "-m", "meshnode", "generate", *peers, "--prompt", p,
                                   "--max-tokens", "32", "--json", "--draft", "ngram"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in prompts]
        outs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err), ref in zip(procs, outs, refs, strict=True):
        assert proc.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["tokens"] == ref.tokens
        assert got["draft"]["steps"] > 0


def test_a_draft_model_gives_the_same_text(route2, copy_reference, model: Path, tmp_path: Path) -> None:
    """``--model-draft``: the route's own model as its drafter (greedy: nearly every draft stands) and a
    tiny random model with the same vocabulary (few stand); both give the whole model's text. A draft
    model of another vocabulary is refused."""
    from tests.tinymodels import make_tiny_model

    peers = [n.endpoint for n in route2]
    same = _gen(peers, "--model-draft", str(model))
    assert same["tokens"] == copy_reference.tokens
    assert same["draft"]["accepted"] >= 0.8 * same["draft"]["drafted"]
    tiny = make_tiny_model(tmp_path / "draft.gguf", "llama", n_layer=2, tokenizer_from=model)
    other = _gen(peers, "--model-draft", str(tiny), "--temperature", "0.8", "--seed", "5")
    assert other["tokens"] == _gen(peers, "--temperature", "0.8", "--seed", "5")["tokens"]
    assert other["draft"]["steps"] > 0
    foreign = make_tiny_model(tmp_path / "foreign.gguf", "llama", n_layer=2, tokenizer_from=model, n_vocab=1024)
    done = cli("generate", *[a for p in peers for a in ("--peer", p)], "--prompt", COPY, "--max-tokens", "8",
               "--model-draft", str(foreign))
    assert done.returncode != 0
    assert "another vocabulary" in done.stderr
    done = cli("generate", *[a for p in peers for a in ("--peer", p)], "--prompt", COPY,
               "--model-draft", str(tmp_path / "missing.gguf"))
    assert done.returncode != 0
    assert "does not exist" in done.stderr


def test_free_text_rests_drafting_in_stretches_and_keeps_the_text(route2, model: Path) -> None:
    """Free text drafts little: drafting rests while the head decodes stretches on its own (delegated
    Generates of 16), tries again, rests again; every stretch returns its flow credits, so none stalls
    (a stall would be a DEADLINE failover here), and the text is the whole model's."""
    prompt = "Once upon a time, in a small town by the sea, there lived a robot who"
    ref = llama_reference(model, prompt, 120)
    got = _gen([n.endpoint for n in route2], "--draft", "ngram", prompt=prompt, n=120)
    assert got["tokens"] == ref.tokens
    assert got["failovers"] == []
    d = got["draft"]
    assert d["steps"] + d["accepted"] < 60  # most tokens came from the head's own stretches


def test_chat_and_three_hops_seeded_with_drafting(route3) -> None:
    """A chat message (the model's chat template) and seeded sampling on 3 hops: the same text drafted."""
    peers = [n.endpoint for n in route3]
    for extra in (("--chat", "Repeat after me: the cat sat on the mat, the cat sat on the mat."),
                  ("--prompt", COPY, "--temperature", "0.9", "--seed", "21")):
        plain = cli("generate", *[a for p in peers for a in ("--peer", p)], "--max-tokens", "32", "--json", *extra)
        drafted = cli("generate", *[a for p in peers for a in ("--peer", p)], "--max-tokens", "32", "--json",
                      "--draft", "ngram", *extra)
        assert plain.returncode == 0, plain.stderr
        assert drafted.returncode == 0, drafted.stderr
        a, b = (json.loads(d.stdout.strip().splitlines()[-1]) for d in (plain, drafted))
        assert b["tokens"] == a["tokens"]
        assert b["draft"]["steps"] > 0


async def test_malformed_draft_steps_get_typed_errors_and_the_session_goes_on(node_factory) -> None:
    """A tail sent draft steps of the wrong shape (more tokens than rows, K past the negotiated chunk,
    K not the tokens' count): each is a typed, non-terminal error, and a good draft step of the same
    session then runs and answers with its samples."""
    import uuid

    import numpy as np

    from meshnode.proto import node_pb2 as pb
    from meshnode.proto import node_pb2_grpc as pb_grpc
    from meshnode.transport.client import open_channel
    from meshnode.wire.schema import SCHEMA_VERSION
    from meshnode.wire.tensors import encode_bundle
    from tests.conftest import aio, open_frame

    tail = await trio.to_thread.run_sync(node_factory, "15:30")

    def draft(sid: str, step_id: int, x: np.ndarray, tokens: list[int], k: int) -> pb.SessionFrame:
        return pb.SessionFrame(route_session_id=sid, route_epoch=1, step=pb.Step(
            step_id=step_id, tokens=tokens, draft=k, sample=True, activation=encode_bundle(x, pos_start=0),
            cache=pb.CacheExpectation(n_past=0)))

    async def go() -> list[pb.SessionReply]:
        async with await open_channel(tail.endpoint) as ch:
            stub = pb_grpc.NodeStub(ch)
            cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
            sid = str(uuid.uuid4())
            call = stub.Session()
            await call.write(open_frame(sid, cap))
            assert (await call.read()).HasField("accepted")
            x = np.random.default_rng(0).standard_normal((600, cap.n_embd)).astype(np.float32)
            replies = []
            for i, frame in enumerate([draft(sid, 1, x[:3], [1, 2, 3, 4], 3),     # 4 tokens, 3 rows
                                       draft(sid, 2, x[:600], list(range(600)), 599),  # past the chunk
                                       draft(sid, 3, x[:3], [1, 2, 3], 5),          # K says 5, 3 tokens
                                       draft(sid, 4, x[:3], [1, 2, 3], 2)], start=1):  # good
                await call.write(frame)
                replies.append(await call.read())
                assert i == len(replies)
            call.cancel()
            return replies

    with trio.fail_after(120):
        replies = await aio(go)
    bad = replies[:3]
    assert [pb.ErrorCode.Name(r.error.code) for r in bad] == ["TENSOR_SHAPE", "TENSOR_SHAPE", "TENSOR_SHAPE"]
    assert not any(r.error.terminal for r in bad)
    good = replies[3]
    assert good.HasField("result"), good
    assert 1 <= len(good.result.tokens) <= 3
    assert len(good.result.pieces) == len(good.result.tokens)
    assert good.result.token == good.result.tokens[-1]
