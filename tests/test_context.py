"""The per-session context (``--ctx-size``): its default, long prompts, and the refusal naming the flag.

The long-context parity test runs a prompt of more than 4,096 tokens through
a two-hop route of real node processes at one ``--ctx-size`` and compares it
with llama-cpp-python's ``Llama(model, n_ctx=<the same>)``: tokens equal,
logits bit for bit.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import trio

from meshnode import errors
from meshnode.errors import RouteError
from meshnode.executor.config import ExecConfig
from meshnode.executor.context import CTX_ALIGN, check_fits, default_ctx_size, kv_bytes_per_token
from meshnode.gguf import inspect_model
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.session.initiator import GenerateConfig, generate
from meshnode.transport.client import open_channel
from meshnode.wire.schema import SCHEMA_VERSION
from tests.conftest import aio, cli, llama_reference, open_frame, step_frame

#: a context above 4096 that a >= 4096-token prompt and a short continuation fit in
LONG_CTX = 4352
#: varied text, repeated until the prompt is long enough
PASSAGES = [
    "The river leaves the mountains in a narrow gorge and widens into a valley of orchards.",
    "Merchants carried salt, copper and wool along the road that followed its northern bank.",
    "In the spring floods the old stone bridge was closed, and ferrymen charged double fares.",
    "A monastery on the hill kept records of every harvest for three hundred and twelve years.",
    "Its library held maps drawn by hand, a treatise on bees, and letters from distant ports.",
]


def long_prompt() -> str:
    parts = []
    for i in range(146):  # ~28 tokens a line: > 4,096 tokens in all
        parts.append(f"{i + 1}. {PASSAGES[i % len(PASSAGES)]} (entry {i * 7 % 101})")
    return "\n".join(parts)


# -- the default (pure) --------------------------------------------------------------


def test_default_is_the_training_context_when_memory_allows():
    per_token = kv_bytes_per_token([3 * (64 + 64)] * 30)  # SmolLM2 whole: 30 layers, 3 KV heads of 64
    assert per_token == 23040
    assert default_ctx_size(8192, per_token, 4, 16 << 30) == 8192


def test_default_shrinks_to_a_quarter_of_available_memory():
    per_token = 23040
    got = default_ctx_size(8192, per_token, 4, 1 << 30)  # 1 GiB available: 256 MiB for 4 sessions' KV
    assert got % CTX_ALIGN == 0
    assert got * per_token * 4 <= (1 << 30) // 4 < (got + CTX_ALIGN) * per_token * 4
    assert default_ctx_size(8192, per_token, 4, 1 << 20) == CTX_ALIGN  # never below one padded block
    assert default_ctx_size(0, per_token, 1, 16 << 30) == 4096  # training context unknown


def test_smollm2_kv_widths_come_from_its_metadata(model):
    info = inspect_model(model)
    assert info.n_ctx_train == 8192
    assert info.kv_widths == (3 * (64 + 64),) * 30


def test_a_prompt_that_does_not_fit_is_refused_naming_the_flag():
    check_fits(500, 12, 512)
    with pytest.raises(errors.InputError, match="--ctx-size") as e:
        check_fits(500, 13, 512)
    assert "513" in str(e.value)


# -- refusals -------------------------------------------------------------------------


def test_local_generate_refuses_a_long_prompt_naming_the_flag(model):
    proc = cli("generate", "--model", str(model), "--prompt", long_prompt(), "--ctx-size", "1024",
               "--max-tokens", "4")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("meshnode: error: INVALID_ARGUMENT")
    assert "--ctx-size" in lines[0]


@pytest.mark.parametrize("value", ["-1", "4294967296"])
def test_ctx_size_out_of_range_is_refused(model, value):
    proc = cli("generate", "--model", str(model), "--prompt", "hi", "--ctx-size", value)
    assert proc.returncode == 2
    assert "--ctx-size" in proc.stderr


def test_route_refuses_a_prompt_beyond_its_smallest_hop(node_factory):
    head = node_factory("0:15", extra=("--ctx-size", "2048", "--max-sessions", "1"))
    tail = node_factory("15:30", extra=("--ctx-size", "512", "--max-sessions", "1"))
    prompt = " ".join(PASSAGES * 3)  # ~300 tokens: fits the head's 2048, not the tail's 512 with 300 more
    proc = cli("generate", "--peer", head.endpoint, "--peer", tail.endpoint, "--prompt", prompt,
               "--max-tokens", "300")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--ctx-size" in lines[0]
    assert tail.endpoint in lines[0]
    assert "512 tokens" in lines[0]
    # hops of unequal contexts still make one route: the context is not a numerics setting
    ok = cli("generate", "--peer", head.endpoint, "--peer", tail.endpoint, "--prompt", prompt,
             "--max-tokens", "4", "--json")
    assert ok.returncode == 0, ok.stderr


# -- long-context parity --------------------------------------------------------------


async def test_route_equals_llama_at_a_long_context(model, node_factory):
    prompt = long_prompt()
    # one prefill of the reference (not a second one through Llama.generate): the test's cost is
    # two 4,100-token prefills, the reference's and the route's
    ref = await trio.to_thread.run_sync(lambda: llama_reference(model, prompt, 4, LONG_CTX, via_generate=False))
    assert 4096 <= len(ref.prompt_tokens) <= LONG_CTX - 4
    extra = ("--ctx-size", str(LONG_CTX), "--max-sessions", "1")
    head, tail = node_factory("0:15", extra=extra), node_factory("15:30", extra=extra)
    # a 512-token chunk at position ~4000 is slow on a busy 2-core host: room per step, so that
    # a slow step is not taken for a dead hop (a failover would still give equal tokens)
    cfg = GenerateConfig(prompt=prompt, max_tokens=4, return_logits=True, step_timeout=180)
    with trio.fail_after(900):  # a hang guard: a 4k prefill takes minutes on a busy 2-vCPU host
        routed = await aio(generate, [head.endpoint, tail.endpoint], cfg)
    assert routed.prompt_tokens == ref.prompt_tokens
    assert routed.tokens == ref.tokens
    for got, want in zip(routed.logits, ref.logits, strict=True):
        assert np.array_equal(got, want)


async def test_a_hop_refuses_a_step_beyond_its_context_naming_the_flag(node_factory):
    tail = node_factory("15:30", extra=("--ctx-size", "256", "--max-sessions", "1"))

    async def go() -> tuple[pb.SessionReply, pb.SessionReply]:
        async with await open_channel(tail.endpoint) as ch:
            stub = pb_grpc.NodeStub(ch)
            cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
            assert cap.numerics.n_ctx_per_session == 256
            sid = str(uuid.uuid4())
            call = stub.Session()
            await call.write(open_frame(sid, cap))
            assert (await call.read()).HasField("accepted")
            x = np.random.default_rng(0).standard_normal((300, cap.n_embd)).astype(np.float32)
            await call.write(step_frame(sid, 1, x, 0, sample=True))
            refused = await call.read()
            await call.write(step_frame(sid, 2, x[:3], 0, sample=True))  # the session goes on
            ok = await call.read()
            call.cancel()
            return refused, ok

    with trio.fail_after(60):
        refused, ok = await aio(go)
    assert pb.ErrorCode.Name(refused.error.code) == "INVALID_ARGUMENT"
    assert "--ctx-size" in refused.error.message
    assert not refused.error.terminal
    assert ok.HasField("result")


def test_long_rope_side_is_part_of_the_numerics(model: Path, tmp_path: Path) -> None:
    """A LongRoPE model (phi3) takes its long factors above its original context (llama-model.cpp
    get_rope_factors): hops on different sides of it would not compute alike, so a route refuses them."""
    from meshnode.executor.context import resolve_ctx
    from meshnode.routing.chain import PeerView, check_chain
    from meshnode.wire import codec
    from tests.tiny import make

    path = make(tmp_path / "phi3.gguf", "phi3", tokenizer_from=model)  # original context 256
    short = resolve_ctx(ExecConfig(n_ctx_per_session=256), path)
    long = resolve_ctx(ExecConfig(n_ctx_per_session=512), path)
    assert short.rope_ctx_orig == long.rope_ctx_orig == 256
    k_short, k_long = (codec.numerics_key(codec.numerics_to_pb(c)) for c in (short, long))
    assert dict(k_short)["long_rope"] is False
    assert dict(k_long)["long_rope"] is True
    peers = [PeerView("a", "fp", 6, 0, 3, k_short), PeerView("b", "fp", 6, 3, 6, k_long)]
    with pytest.raises(RouteError, match="long_rope"):
        check_chain(peers)
    check_chain([peers[0], PeerView("b", "fp", 6, 3, 6, codec.numerics_key(codec.numerics_to_pb(
        resolve_ctx(ExecConfig(n_ctx_per_session=128), path))))])
    # a model without LongRoPE factors: the context is no numerics setting at all
    plain = resolve_ctx(ExecConfig(n_ctx_per_session=4096), model)
    assert plain.rope_ctx_orig == 0
    assert dict(codec.numerics_key(codec.numerics_to_pb(plain)))["long_rope"] is False
