"""Sampling is llama.cpp's chain, built as ``Llama.create_completion`` builds it.

For several seeds and parameter sets (defaults, penalties and every cut-off, a stop string,
greedy with a repeat penalty) the text and tokens of a 2-hop route equal
``llama_cpp.Llama(model).create_completion(prompt, ..., seed=S)`` on the whole model and
``generate --model`` here. A tail SIGKILLed mid-generation at temperature > 0 is replaced by a
spare whose rebuilt sampler continues exactly; a head killed likewise leaves the tail to rebuild
its own. Plus the pieces: the chain's rebuild, the text cut (EOG, stop strings, hold-back while
streaming), and the checks on every parameter.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
import trio

from meshnode import errors
from meshnode.executor.config import ExecConfig
from meshnode.executor.sampler import Chain
from meshnode.session.completion import Completion
from meshnode.session.initiator import GenerateConfig, GenerationResult, generate
from meshnode.session.local import generate_local
from meshnode.session.sampling import SamplingParams, check_sampling, from_pb, to_pb
from meshnode.transport.client import health
from tests.conftest import PROMPT, aio, cli, initiator

N = 32
#: (sampling, stop strings): each run at its seeds
CASES: list[tuple[SamplingParams, tuple[str, ...]]] = [
    (SamplingParams(seed=1), ()),  # Llama.create_completion's defaults
    (SamplingParams(seed=1234567), ()),
    (SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.02, typical_p=0.9, repeat_penalty=1.3,
                    frequency_penalty=0.4, presence_penalty=0.3, seed=11), ()),
    (SamplingParams(temperature=0.7, seed=3), (",", " and")),
    (SamplingParams(temperature=0.0, repeat_penalty=1.5, frequency_penalty=0.2), ()),  # greedy, penalized
]


def llama_completion(model: Path, prompt: str, p: SamplingParams, stop: tuple[str, ...], n: int) -> dict[str, Any]:
    """The whole model through llama-cpp-python's own ``create_completion``, fresh ``Llama`` (default context)."""
    llm = llama_cpp.Llama(str(model), verbose=False)
    try:
        out = llm.create_completion(prompt, max_tokens=n, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                    min_p=p.min_p, typical_p=p.typical_p, repeat_penalty=p.repeat_penalty,
                                    frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                                    seed=p.seed, stop=list(stop))
        assert isinstance(out, dict)
        return {"text": out["choices"][0]["text"], "finish": out["choices"][0]["finish_reason"],
                "n_tokens": out["usage"]["completion_tokens"]}
    finally:
        llm.close()


def same_as_llama(result: GenerationResult, want: dict[str, Any]) -> None:
    assert result.text == want["text"]
    assert len(result.tokens) == want["n_tokens"]  # Llama counts the token that completed a stop string
    assert {"eog": "stop", "stop": "stop", "length": "length"}[result.stop_reason] == want["finish"]


@pytest.mark.parametrize(("params", "stop"), CASES, ids=["defaults", "defaults-seed2", "penalties+cutoffs",
                                                         "stop-strings", "greedy-penalized"])
async def test_route_and_local_equal_llama_create_completion(model, route2, params, stop):
    want = await trio.to_thread.run_sync(llama_completion, model, PROMPT, params, stop, N)
    cfg = GenerateConfig(prompt=PROMPT, max_tokens=N, sampling=params, stop=stop)
    with trio.fail_after(120):
        routed = await aio(generate, [n.endpoint for n in route2], cfg)
    same_as_llama(routed, want)
    local = await trio.to_thread.run_sync(generate_local, model, cfg, ExecConfig())
    same_as_llama(local, want)
    assert local.tokens == routed.tokens
    if stop:  # the case must exercise the cut it claims to
        assert routed.stop_reason == "stop"
        assert not any(s in routed.text for s in stop)
        # ended mid-Generate (the head was still decoding): the release frees every hop's KV at once
        for n in route2:
            h = await aio(health, n.endpoint)
            assert (h.live_sessions, h.detached_sessions) == (0, 0), n.endpoint
    assert routed.seed == (params.seed if params.temperature > 0 else None)


async def test_a_different_seed_gives_a_different_text(route2):
    """The seed reaches the tail's dist sampler (else every case above could pass on one fixed text)."""
    texts = set()
    for seed in (1, 2, 3):
        cfg = GenerateConfig(prompt=PROMPT, max_tokens=16, sampling=SamplingParams(temperature=1.0, seed=seed))
        with trio.fail_after(60):
            texts.add((await aio(generate, [n.endpoint for n in route2], cfg)).text)
    assert len(texts) > 1


def test_cli_without_seed_draws_one_reports_it_and_it_repeats_across_a_route(model, route2):
    local = cli("generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "16",
                "--temperature", "0.9", "--json")
    assert local.returncode == 0, local.stderr
    m = re.search(r"seed (\d+) \(repeat this run with --seed \1\)", local.stderr)
    assert m, local.stderr
    out = json.loads(local.stdout)
    assert out["seed"] == int(m.group(1))
    routed = cli("generate", *[a for n in route2 for a in ("--peer", n.endpoint)], "--prompt", PROMPT,
                 "--max-tokens", "16", "--temperature", "0.9", "--seed", m.group(1), "--json")
    assert routed.returncode == 0, routed.stderr
    assert "seed" not in routed.stderr  # given, not drawn
    again = json.loads(routed.stdout)
    assert (again["text"], again["tokens"], again["seed"]) == (out["text"], out["tokens"], out["seed"])


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--temperature", "nan", "--temperature must be a finite number >= 0"),
    ("--top-p", "1.5", "--top-p must be within [0, 1]"),
    ("--repeat-penalty", "0", "--repeat-penalty must be a finite number > 0"),
    ("--seed", "4294967295", "--seed must be within 0..4294967294"),
    ("--top-k", "-1", "--top-k must be within"),
    ("--stop", "", "a stop string must not be empty"),
])
def test_cli_refuses_bad_sampling_flags_in_one_line(model, flag, value, message):
    proc = cli("generate", "--model", str(model), "--prompt", "hi", flag, value)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


# -- failover: the sampler's state is rebuilt --------------------------------------------------

KILL_AFTER = 5
FAIL_N = 40
FAIL_PARAMS = SamplingParams(temperature=1.1, repeat_penalty=1.2, presence_penalty=0.2, seed=77)


def _sampling_flags(p: SamplingParams) -> list[str]:
    return ["--temperature", str(p.temperature), "--top-k", str(p.top_k), "--top-p", str(p.top_p),
            "--min-p", str(p.min_p), "--typical-p", str(p.typical_p), "--repeat-penalty", str(p.repeat_penalty),
            "--frequency-penalty", str(p.frequency_penalty), "--presence-penalty", str(p.presence_penalty),
            "--seed", str(p.seed)]


@pytest.fixture(scope="module")
def uninterrupted(model) -> dict[str, Any]:
    return llama_completion(model, PROMPT, FAIL_PARAMS, (), FAIL_N)


@pytest.mark.parametrize(("victim", "spare"), [(1, "15:30"), (0, "0:15")], ids=["tail", "head"])
async def test_killed_hop_mid_sampling_continues_the_same_text(node_factory, uninterrupted, victim, spare):
    """A new tail rebuilds the chain from the tokens sampled so far; when the head dies, the old tail
    adopts its detached session and rebuilds its chain too (it may have sampled past what arrived)."""
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ("0:15", "15:30")]
    sp = await trio.to_thread.run_sync(node_factory, spare)
    cmd = [sys.executable, "-m", "meshnode", "generate", *[a for n in nodes for a in ("--peer", n.endpoint)],
           "--spare", sp.endpoint, "--prompt", PROMPT, "--max-tokens", str(FAIL_N), *_sampling_flags(FAIL_PARAMS),
           "--stream", "--json"]
    lines: list[dict[str, Any]] = []

    def on_line(line: bytes) -> None:
        lines.append(json.loads(line))
        if len(lines) == KILL_AFTER:
            nodes[victim].proc.send_signal(signal.SIGKILL)

    async with initiator(cmd, timeout=120, on_line=on_line) as run:
        pass
    assert run.proc.returncode == 0, run.text()
    result = lines[-1]
    (f,) = result["failovers"]  # the kill landed mid-generation
    assert f["hop"] == nodes[victim].endpoint
    assert f["replacement"] == [sp.endpoint]
    assert result["text"] == uninterrupted["text"], run.text()
    assert len(result["tokens"]) == uninterrupted["n_tokens"]
    assert "".join(s["piece"] for s in lines[:-1]) == result["text"]


# -- the pieces -------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(seed=5),
    SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.4, presence_penalty=0.3, seed=9),
    SamplingParams(temperature=0.0, repeat_penalty=1.3),
])
def test_a_rebuilt_chain_continues_exactly_where_the_original_was(params):
    """One draw per sample whatever the logits (llama_sampler_dist_apply): advance() over the sampled
    tokens puts a fresh chain of the same seed in the same state, penalty window included."""
    rng = np.random.default_rng(3)
    rows = [(rng.standard_normal(512) * 3).astype(np.float32) for _ in range(80)]
    with Chain(params, 512) as original:
        run = [original.sample(r) for r in rows]
    for k in (1, 17, 70):  # 70 > the 64-token penalty window
        with Chain(params, 512) as rebuilt:
            for t in run[:k]:
                rebuilt.advance(t)
            assert [rebuilt.sample(r) for r in rows[k:]] == run[k:]
    if params.temperature > 0:  # without the advance the draws are out of step: the check could fail
        with Chain(params, 512) as fresh:
            assert [fresh.sample(r) for r in rows[17:]] != run[17:]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=0.0, repeat_penalty=1.0, penalty_last_n=0)])
def test_greedy_picks_what_llamas_greedy_sampler_picks(params):
    """The greedy fast path (np.argmax, no candidate array) against llama.cpp's chain on the same rows:
    ties (the first maximum wins), a maximum at either end, a row with a NaN (it goes to llama.cpp)."""
    rng = np.random.default_rng(11)
    rows = [np.round(rng.standard_normal(512) * 2).astype(np.float32) for _ in range(60)]  # many ties
    rows += [np.zeros(512, dtype=np.float32), np.arange(512, dtype=np.float32), -np.arange(512, dtype=np.float32)]
    nan = rng.standard_normal(512).astype(np.float32)
    nan[[0, 7]] = np.nan
    rows.append(nan)
    with Chain(params, 512) as fast, Chain(params, 512) as full:
        assert fast.argmax
        full.argmax = False
        assert [fast.sample(r) for r in rows] == [full.sample(r) for r in rows]
    with Chain(SamplingParams(temperature=0.0, repeat_penalty=1.3), 512) as penalised:
        assert not penalised.argmax  # a penalty moves the logits: only llama.cpp's chain knows by how much


def test_the_chain_is_llamas_on_llamas_own_logits(model):
    """Fed the whole model's logits row by row, the chain picks Llama.create_completion's tokens."""
    p = SamplingParams(temperature=0.9, repeat_penalty=1.1, seed=21)
    want = llama_completion(model, PROMPT, p, (), 16)
    llm = llama_cpp.Llama(str(model), verbose=False)
    try:
        llm.eval(llm.tokenize(PROMPT.encode(), special=True))
        out: list[int] = []
        with Chain(p, llm.n_vocab()) as chain:
            while len(out) < 16:
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
                tok = chain.sample(row.copy())
                if llm.token_eos() == tok:
                    break
                out.append(tok)
                llm.eval([tok])
        assert llm.detokenize(out).decode("utf-8", errors="ignore") == want["text"]
    finally:
        llm.close()


def _feed(c: Completion, pieces: list[bytes], eog_at: int = -1) -> list[bytes]:
    released = []
    for i, piece in enumerate(pieces):
        done = c.add(i, piece, eog=i == eog_at)
        released.append(c.release())
        if done:
            break
    return released


def test_completion_cuts_as_llama_does():
    c = Completion(max_tokens=10, stops=(b"lo", b"ell"))
    streamed = _feed(c, [b"He", b"l", b"lo w"])
    # both occur; the first *in the order given* cuts, where it first occurs
    assert (c.finish, c.raw, c.tokens) == ("stop", b"Hel", [0, 1, 2])
    # "e", then "el" were held back while they could start "ell"
    assert streamed == [b"H", b"", b"el"]
    c = Completion(max_tokens=10)
    _feed(c, [b"a", b"b", b"<eog piece>"], eog_at=2)
    assert (c.finish, c.raw, c.tokens) == ("eog", b"ab", [0, 1])  # the EOG token is neither text nor token
    c = Completion(max_tokens=2)
    _feed(c, [b"a", b"\xe2", b"\x82", b"\xac", b"b"])
    # the text ended mid-character at max_tokens: Llama lets it run on until the character is whole
    assert (c.finish, c.text) == ("length", "a\u20ac")
    c = Completion(max_tokens=5, bos=0)  # _feed numbers the tokens 0, 1, ...: the first is "BOS"
    _feed(c, [b"", b" hi"])
    assert c.raw == b"hi"  # detokenize drops the space after a leading BOS


def test_sampling_checks_refuse_what_llama_cpp_cannot_repeat_or_honour():
    for bad in [dict(temperature=float("nan")), dict(temperature=-0.5), dict(top_p=1.01), dict(min_p=-0.1),
                dict(typical_p=float("inf")), dict(repeat_penalty=0.0), dict(frequency_penalty=float("nan")),
                dict(presence_penalty=float("-inf")), dict(top_k=-1), dict(top_k=2**31), dict(seed=2**32 - 1),
                dict(seed=-1)]:
        with pytest.raises(errors.InputError):
            check_sampling(dataclasses.replace(SamplingParams(), **bad))
    p = SamplingParams(temperature=0.5, top_k=7, top_p=0.5, min_p=0.25, typical_p=0.75, repeat_penalty=1.5,
                       frequency_penalty=-0.5, presence_penalty=0.25, penalty_last_n=32, seed=99)
    assert from_pb(to_pb(p)) == p  # exact in float32
    from meshnode.proto import node_pb2 as pb

    assert from_pb(pb.Sampling()) == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                                                    seed=0)  # unset = no effect: plain greedy
