"""Parity of cuts against the whole model, on real llama.cpp: the helpers every arch test uses.

``run_whole`` runs the whole file as one ``LlamaRange`` (which equals
llama-cpp-python's ``Llama`` bit for bit: ``check_whole``), ``run_chain``
runs head -> middles -> tail, each range its own ``LlamaRange`` in this
process, greedy; ``assert_same_run`` wants identical tokens and logits.
``check_every_cut`` splits a model into 2 hops at every boundary a policy
allows and into 3 hops at the given points, and checks each refused
boundary is refused with its reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnode.errors import CutRefusedError
from meshnode.executor._llama import LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.gguf.arch import boundary_verdicts
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import inspect_model
from meshnode.gguf.slicer import Role, ensure_range
from tests.conftest import llama_reference

#: 44 tokens with the truncated vocabulary: longer than every tiny model's window
PROMPT = "The quick brown fox jumps over the lazy dog, while the cat sleeps on a warm mat near the open door."
N_DECODE = 8

Cut = Sequence[tuple[int, int]]


@dataclass
class Run:
    prompt_tokens: list[int]
    #: greedy tokens, one per logits row
    tokens: list[int]
    #: logits of the last prompt token, then of each generated token
    logits: list[np.ndarray]


def _greedy(first: LlamaRange, rest: list[LlamaRange], toks: list[int], n: int) -> Run:
    run = Run(toks, [], [])
    step, pos = np.asarray(toks, dtype=np.int32), 0
    while len(run.tokens) < n:
        for i in range(0, len(step), first.config.n_batch):  # a long prompt in chunks of n_batch, as a route
            chunk = step[i : i + first.config.n_batch]
            out = first.forward(0, pos, tokens=chunk)
            for r in rest:
                assert out.residual is not None
                assert out.residual.shape == (len(chunk), first.n_embd)
                assert np.isfinite(out.residual).all()
                out = r.forward(0, pos, embd=out.residual)
            pos += len(chunk)
        assert out.logits is not None
        run.logits.append(out.logits)
        run.tokens.append(int(np.argmax(out.logits)))
        step = np.asarray(run.tokens[-1:], dtype=np.int32)
    return run


def run_whole(path: Path, prompt: str = PROMPT, n: int = N_DECODE + 1, config: ExecConfig | None = None) -> Run:
    n_layer = inspect_model(path).n_layer
    art = ensure_range(path, 0, n_layer)
    assert art.role is Role.WHOLE
    r = LlamaRange(art, config or ExecConfig())
    try:
        assert r.vocab is not None
        return _greedy(r, [], r.vocab.tokenize(prompt), n)
    finally:
        r.close()


def run_chain(path: Path, cut: Cut, prompt: str = PROMPT, n: int = N_DECODE + 1,
              config: ExecConfig | None = None) -> Run:
    """Greedy generation head -> middles -> tail, each range its own executor."""
    n_layer = inspect_model(path).n_layer
    assert cut[0][0] == 0
    assert cut[-1][1] == n_layer
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cut))
    arts = [ensure_range(path, a, b) for a, b in cut]
    assert [a.role for a in arts] == [Role.HEAD, *[Role.MIDDLE] * (len(cut) - 2), Role.TAIL]
    for art in arts:
        assert_loadable_swa(art.range_path)
    ranges: list[LlamaRange] = []
    try:
        for art in arts:
            ranges.append(LlamaRange(art, config or ExecConfig()))
        tail = ranges[-1]
        assert tail.vocab is not None  # the tail tokenizes; the head holds only the token table
        run = _greedy(ranges[0], ranges[1:], tail.vocab.tokenize(prompt), n)
        assert all(lg.shape == (tail.n_vocab_out,) for lg in run.logits)
        return run
    finally:
        for r in reversed(ranges):
            r.close()


def assert_same_run(got: Run, want: Run) -> None:
    assert got.prompt_tokens == want.prompt_tokens
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    for i, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert g.dtype == np.float32
        assert w.dtype == np.float32
        assert np.isfinite(g).all()
        if not np.array_equal(g, w):
            diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
            pytest.fail(f"logits of step {i} differ: max |diff| {diff.max():.3g} at token {int(diff.argmax())}")


def assert_loadable_swa(path: Path) -> None:
    """Fail (instead of letting llama.cpp abort the test process) on a window without SWA layers.

    llama.cpp's create_memory (src/llama-model.cpp, ``GGML_ASSERT(hparams.is_swa_any())``)
    aborts when a file declares a sliding window but no layer uses it.
    """
    reader = gguf.GGUFReader(path, "r")
    arch = reader.fields["general.architecture"].contents()
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    pattern = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if window is None or not window.contents() or pattern is None:
        return
    flags = pattern.contents()
    if isinstance(flags, list) and not any(flags):
        pytest.fail(
            f"{path} declares {arch}.attention.sliding_window={window.contents()} but none of its "
            f"{len(flags)} layers is sliding-window: llama.cpp would abort loading it"
        )


def check_whole(path: Path, prompt: str = PROMPT) -> Run:
    """The whole model as one LlamaRange is llama-cpp-python's Llama, bit for bit; returns its run."""
    whole = run_whole(path, prompt)
    # every step computes something new (a random model may repeat one token; its logits still move)
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(whole.logits))
    ref = llama_reference(path, prompt, N_DECODE + 1)
    assert_same_run(whole, Run(ref.prompt_tokens, ref.tokens, ref.logits))
    return whole


def check_every_cut(path: Path, three_hop: Sequence[Cut] = (), prompt: str = PROMPT) -> list[int]:
    """Every boundary the policy allows, cut into 2 hops, and each of ``three_hop``: equal to the
    whole model. Every boundary it refuses is refused by the slicer, naming the reason.
    Returns the boundaries cut."""
    info = inspect_model(path)
    whole = check_whole(path, prompt)
    verdicts = boundary_verdicts(read_meta(path, full=True).fields, info.arch, info.n_layer)
    for k in range(1, info.n_layer):
        reason = verdicts.reason(k)
        if reason is None:
            assert_same_run(run_chain(path, [(0, k), (k, info.n_layer)], prompt), whole)
        else:
            with pytest.raises(CutRefusedError, match=f"at layer {k}"):
                ensure_range(path, 0, k)
    for cut in three_hop:
        assert len(cut) >= 3
        assert_same_run(run_chain(path, cut, prompt), whole)
    return verdicts.cuttable
