"""Windowed graphs cut exactly where llama.cpp allows, refused with the reason elsewhere.

Proves, on real llama.cpp, for tiny random models built as each loader reads them
(tests/tiny/windowed.py):

* cohere2 (8 layers, window 8 on 3 of every 4, RoPE only on those, parallel
  block, logit scale, tied lm_head) and gpt-oss (6 layers, window 8 on even
  layers, attention sinks, biased experts and router, YaRN, required
  output.weight): every boundary whose both sides hold a windowed layer cut in 2
  hops, and two 3-hop cuts, give the whole model's tokens and logits bit for
  bit (the 44-token prompt and 8 decode steps run past the window, which is
  shown to matter). The boundary before a global last layer is refused, and so
  is a middle range of only global layers: llama.cpp's graph always builds a
  windowed cache and asserts ``is_swa_any()``. gpt-oss's non-tail hops capture
  every row of ``l_out-{n-1}`` (the capture checks its byte count).
* llama4, Maverick-like (16 layers, experts + shared expert on odd layers,
  NoPE + temperature on every 4th, chunked attention on the rest, rope_freqs):
  only multiples of 4 are cut (2 hops each, two 3-hop cuts), the rest refused
  naming the RoPE/expert phase. Scout-like (10 layers, experts everywhere, an
  explicit chunk pattern that matters through ``rope.freq_base_swa``): the cut
  at 8 would leave a tail without a RoPE-less layer, whose unused temperature
  input llama.cpp aborts setting ("tensor buffer not set"): refused. A file
  declaring ``sliding_window = 0`` is refused at every boundary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnode.errors import CutRefusedError
from meshnode.gguf.arch import boundary_verdicts, check_cut
from meshnode.gguf.meta import read_meta
from meshnode.gguf.slicer import ensure_range
from tests.archcheck import check_every_cut, run_whole
from tests.tiny import make

#: name -> (builder, Spec overrides, 3-hop cuts, boundaries expected to be cut)
CASES: dict[str, tuple[str, dict[str, Any], list[list[tuple[int, int]]], list[int]]] = {
    "cohere2": ("cohere2", {"n_layer": 8},
                [[(0, 3), (3, 5), (5, 8)], [(0, 1), (1, 6), (6, 8)]], [1, 2, 3, 4, 5, 6]),
    "gpt-oss": ("gpt-oss", {},
                [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 3), (3, 6)]], [1, 2, 3, 4]),
    "llama4-maverick": ("llama4", {},
                        [[(0, 4), (4, 12), (12, 16)], [(0, 8), (8, 12), (12, 16)]], [4, 8, 12]),
    "llama4-scout": ("llama4", {"n_layer": 10, "seed": 1, "extra_kv": {
        "llama4.interleave_moe_layer_step": 1,
        "llama4.rope.freq_base_swa": 20000.0,
        "llama4.attention.sliding_window_pattern": [True, False, True, True, False, True, True, True, True, False],
    }}, [], [4]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_cut_equals_whole(name: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    builder, spec, three_hop, want = CASES[name]
    path = make(tmp_path / f"{name}.gguf", builder, tokenizer_from=model, **spec)
    assert check_every_cut(path, three_hop=three_hop) == want


@pytest.mark.parametrize(("name", "global_range", "last"), [("cohere2", (3, 4), 7), ("gpt-oss", (1, 2), 5)])
def test_only_global_layers_refused(name: str, global_range: tuple[int, int], last: int, model: Path,
                                    tiny_cache: Path, tmp_path: Path) -> None:
    builder, spec, _, _ = CASES[name]
    path = make(tmp_path / f"{name}.gguf", builder, tokenizer_from=model, **spec)
    meta = read_meta(path, full=True).fields
    n_layer = int(meta[f"{name}.block_count"])
    a, b = global_range
    with pytest.raises(CutRefusedError, match=r"hold no sliding-window layer.*is_swa_any"):
        check_cut(meta, name, n_layer, a, b)
    with pytest.raises(CutRefusedError, match=r"hold no sliding-window layer"):
        ensure_range(path, a, b)
    reason = boundary_verdicts(meta, name, n_layer).reason(last)
    assert reason is not None
    assert "no sliding-window layer" in reason


@pytest.mark.parametrize("name", ["cohere2", "gpt-oss"])
def test_window_matters(name: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """The same weights with a window longer than the whole run compute something else."""
    builder, spec, _, _ = CASES[name]
    narrow = run_whole(make(tmp_path / "w8.gguf", builder, tokenizer_from=model, **spec))
    wide_spec = {**spec, "extra_kv": {f"{name}.attention.sliding_window": 4096}}
    wide = run_whole(make(tmp_path / "w4096.gguf", builder, tokenizer_from=model, **wide_spec))
    assert not np.array_equal(narrow.logits[0], wide.logits[0])


def test_llama4_pattern_matters(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """llama4's chunk is 8192 whatever the file says, so here the flags show through the rope base of the
    full-attention layers that keep RoPE: dropping the explicit pattern (3 chunked, 1 full) changes the logits."""
    builder, spec, _, _ = CASES["llama4-scout"]
    explicit = run_whole(make(tmp_path / "explicit.gguf", builder, tokenizer_from=model, **spec))
    kv = {k: v for k, v in spec["extra_kv"].items() if not k.endswith("sliding_window_pattern")}
    default = run_whole(make(tmp_path / "default.gguf", builder, tokenizer_from=model, **{**spec, "extra_kv": kv}))
    assert not np.array_equal(explicit.logits[0], default.logits[0])


def test_llama4_refusals_name_the_reason(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    builder, spec, _, _ = CASES["llama4-maverick"]
    path = make(tmp_path / "maverick.gguf", builder, tokenizer_from=model, **spec)
    v = boundary_verdicts(read_meta(path, full=True).fields, "llama4", 16)
    assert "multiples of 4" in (v.reason(2) or "")
    assert "(il + 1) % 2 == 0" in (v.reason(6) or "")
    builder, spec, _, _ = CASES["llama4-scout"]
    path = make(tmp_path / "scout.gguf", builder, tokenizer_from=model, **spec)
    v = boundary_verdicts(read_meta(path, full=True).fields, "llama4", 10)
    assert "no layer without RoPE" in (v.reason(8) or "")
    with pytest.raises(CutRefusedError, match="tensor buffer not set"):
        ensure_range(path, 8, 10)


def test_llama4_without_chunks_refused(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """``sliding_window = 0``: RoPE is skipped on the loaded model's own last layer; never cut (such a file
    is not run here: llama.cpp aborts it even whole, GGML_ASSERT(f_attn_temp_scale != 0.0f))."""
    path = make(tmp_path / "nochunk.gguf", "llama4", tokenizer_from=model, n_layer=8,
                extra_kv={"llama4.attention.sliding_window": 0})
    v = boundary_verdicts(read_meta(path, full=True).fields, "llama4", 8)
    assert v.cuttable == []
    assert "n_no_rope_layer_step = n_layer()" in (v.reason(4) or "")
    with pytest.raises(CutRefusedError, match="at layer 4: llama4 without chunked attention"):
        ensure_range(path, 0, 4)
