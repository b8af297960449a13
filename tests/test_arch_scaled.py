"""Graphs that scale their input (granite, granitemoe, gemma2) and phi3, cut exactly on real llama.cpp.

Each tiny model (6 layers, tests/tiny/scaled.py) is cut at every boundary its policy allows into
2 hops and at two points into 3 hops; tokens and logits equal the whole model's bit for bit
(``check_every_cut``). Beyond that, this file shows:

* granite/granitemoe: the head keeps ``embedding_scale`` (12) and middle and tail slices state 0,
  llama.cpp's "no scale" (``build_inp_embd``); granitemoe with 8 experts (2 used) and a shared
  expert; a Granite Vision ``deepstack_mapping`` is refused at every boundary;
* gemma2: the ``inp_scaled`` restore (native/capture.c) is what makes middle and tail hops exact
  (without it the same route differs), also with several sessions in one llama_decode (prefill
  and decode, in one micro-batch and, for non-consecutive sequence ids, in several); its window
  of 8 matters (4096 gives other logits); the last layer, global, cannot be a hop alone (refused
  at layer 5), nor can any global layer; a 46-layer model (27B's attention scale) is refused at
  every boundary, a 46-layer slice too;
* phi3: exact with the long and with the short LongRoPE factors (which differ), and its declared
  window is ignored by llama.cpp (the same weights without it give identical logits).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.errors import CutRefusedError
from meshnode.executor._llama import Chunk, LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.gguf.arch import InputScale, boundary_verdicts, check_cut
from meshnode.gguf.archtable import POLICIES
from meshnode.gguf.meta import read_meta
from meshnode.gguf.slicer import ensure_range
from tests.archcheck import assert_same_run, check_every_cut, run_chain, run_whole
from tests.tiny import make

THREE_HOP = [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]]
#: gemma2's layer 5 is global: no hop can be [5, 6)
GEMMA2_THREE_HOP = [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 3), (3, 6)]]

#: name -> (builder, spec overrides, three-hop cuts, boundaries cut)
CASES: dict[str, tuple[str, dict[str, Any], list[list[tuple[int, int]]], list[int]]] = {
    "granite": ("granite", {}, THREE_HOP, [1, 2, 3, 4, 5]),
    # rope.scaling.finetuned false: granite's switch that turns rope off in every layer
    "granite-norope": ("granite", {"seed": 1, "extra_kv": {"granite.rope.scaling.finetuned": False}},
                       THREE_HOP, [1, 2, 3, 4, 5]),
    "granitemoe": ("granitemoe", {}, THREE_HOP, [1, 2, 3, 4, 5]),
    "gemma2": ("gemma2", {}, GEMMA2_THREE_HOP, [1, 2, 3, 4]),
    "phi3-long": ("phi3", {}, THREE_HOP, [1, 2, 3, 4, 5]),
    "phi3-short": ("phi3", {"extra_kv": {"phi3.rope.scaling.original_context_length": 2048}},
                   THREE_HOP, [1, 2, 3, 4, 5]),
    # Phi-4-mini-like: tied lm_head (token_embd), 12 of 16 head dimensions rotated
    "phi3-partial-rope": ("phi3", {"tied": True, "seed": 1, "extra_kv": {"phi3.rope.dimension_count": 12}},
                          THREE_HOP, [1, 2, 3, 4, 5]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_cut_equals_whole(case: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    name, spec, three_hop, cut = CASES[case]
    path = make(tmp_path / f"{case}.gguf", name, tokenizer_from=model, **spec)
    assert check_every_cut(path, three_hop=three_hop) == cut


def _meta(path: Path) -> dict[str, Any]:
    return dict(read_meta(path, full=True).fields)


def test_granite_embedding_scale_only_in_the_head(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / "granite.gguf", "granite", tokenizer_from=model)
    scales = [_meta(ensure_range(path, a, b).range_path)["granite.embedding_scale"] for a, b in THREE_HOP[0]]
    assert scales == [pytest.approx(12.0), 0.0, 0.0]


def test_granite_deepstack_refused(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / "granite-ds.gguf", "granite", tokenizer_from=model,
                extra_kv={"granite.deepstack_mapping": [-1, -1, 1, -1, -1, -1]})
    verdicts = boundary_verdicts(_meta(path), "granite", 6)
    assert verdicts.cuttable == []
    assert "deepstack_mapping" in (verdicts.reason(3) or "")
    with pytest.raises(CutRefusedError, match="at layer 3: it declares a deepstack_mapping"):
        ensure_range(path, 0, 3)


def test_gemma2_restore_and_window_matter(model: Path, tiny_cache: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = make(tmp_path / "gemma2.gguf", "gemma2", tokenizer_from=model)
    whole = run_whole(path)
    cut = [(0, 2), (2, 4), (4, 6)]
    assert_same_run(run_chain(path, cut), whole)
    # the same slices, without putting the hop's input back into inp_scaled: scaled twice
    monkeypatch.setitem(POLICIES, "gemma2", dataclasses.replace(POLICIES["gemma2"], input_scale=InputScale.NONE))
    unrestored = run_chain(path, cut)
    assert not np.array_equal(unrestored.logits[0], whole.logits[0])
    monkeypatch.undo()
    wide = make(tmp_path / "gemma2-wide.gguf", "gemma2", tokenizer_from=model,
                extra_kv={"gemma2.attention.sliding_window": 4096})
    assert not np.array_equal(run_whole(wide).logits[0], whole.logits[0])


def _chain_steps(hops: list[LlamaRange], seqs: list[int], prompts: list[np.ndarray],
                 n: int) -> list[list[np.ndarray]]:
    """Greedy steps of several sessions through ``hops``, all sessions in one batch per hop."""
    logits: list[list[np.ndarray]] = [[] for _ in seqs]
    steps, pos = list(prompts), [0] * len(seqs)
    for _ in range(n):
        outs: list[Any] = [None] * len(seqs)
        for h, hop in enumerate(hops):
            chunks = [Chunk(s, pos[i], tokens=steps[i]) if h == 0 else Chunk(s, pos[i], embd=outs[i].residual)
                      for i, s in enumerate(seqs)]
            outs = hop.forward_many(chunks)
            assert not any(isinstance(o, Exception) for o in outs), outs
        for i in range(len(seqs)):
            logits[i].append(outs[i].logits)
            pos[i] += len(steps[i])
            steps[i] = np.asarray([int(np.argmax(outs[i].logits))], np.int32)
    for hop in hops:
        for s in seqs:
            hop.release(s)
    return logits


def test_gemma2_restore_with_batched_sessions(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / "gemma2.gguf", "gemma2", tokenizer_from=model)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(20, 1000, 12).astype(np.int32) for _ in range(3)]
    hops = [LlamaRange(ensure_range(path, a, b), ExecConfig()) for a, b in [(0, 2), (2, 4), (4, 6)]]
    try:
        alone = [_chain_steps(hops, [0], [p], 4)[0] for p in prompts]
        for seqs in ([0, 1, 2], [0, 1, 3]):  # one micro-batch; seq 3 after 1 makes llama.cpp split
            together = _chain_steps(hops, seqs, prompts, 4)
            for got, want in zip(together, alone, strict=True):
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(g, w)
    finally:
        for hop in reversed(hops):
            hop.close()


def test_gemma2_global_only_ranges_refused(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / "gemma2.gguf", "gemma2", tokenizer_from=model)
    for a, b in [(1, 2), (3, 4)]:
        with pytest.raises(CutRefusedError, match="hold no sliding-window layer"):
            ensure_range(path, a, b)
    ensure_range(path, 2, 3)  # a local layer alone is a valid hop


def test_gemma2_27b_layer_count_refused() -> None:
    meta = {"gemma2.block_count": 46, "gemma2.embedding_length": 4608, "gemma2.attention.head_count": 32,
            "gemma2.attention.key_length": 128, "gemma2.attention.sliding_window": 4096}
    verdicts = boundary_verdicts(meta, "gemma2", 46)
    assert verdicts.cuttable == []
    assert "layer count" in (verdicts.reason(23) or "")
    bigger = {**meta, "gemma2.block_count": 50}
    check_cut(bigger, "gemma2", 50, 0, 44)
    with pytest.raises(CutRefusedError, match="46-layer slice"):
        check_cut(bigger, "gemma2", 50, 0, 46)


def test_phi3_rope_factors_matter_and_window_is_ignored(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    long = run_whole(make(tmp_path / "phi3.gguf", "phi3", tokenizer_from=model))
    short = run_whole(make(tmp_path / "phi3-short.gguf", "phi3", tokenizer_from=model,
                           extra_kv={"phi3.rope.scaling.original_context_length": 2048}))
    assert not np.array_equal(long.logits[0], short.logits[0])
    unwindowed = run_whole(make(tmp_path / "phi3-nowin.gguf", "phi3", tokenizer_from=model,
                                extra_kv={"phi3.attention.sliding_window": 0}))
    assert_same_run(unwindowed, long)
