"""Cuts are exact for every supported graph, on real llama.cpp execution.

For llama (and a Mistral-like llama: GQA, rope base 1e6, untied lm_head),
qwen2 (q/k/v biases), qwen3 (q/k norms) and gemma3 (q/k norms, post norms,
sqrt(n_embd) input scale, a sliding window of 8 on 5 of every 6 layers, a
different rope base on its local layers) a tiny random-weight model of 12
layers is cut at even and uneven points. A prompt longer than the sliding
window plus 8 greedy steps go head -> middles -> tail, each range its own
``LlamaRange``; the tail's logits at every step equal, bit for bit, those of
the whole model as one ``LlamaRange`` and those of llama-cpp-python's
``Llama`` with its default settings.

The tiny models carry the default model's real BPE tokenizer cut to its first
1024 tokens (``tinymodels.truncated_vocab``): the gguf package needs ~2 s to
parse the full 49152-token vocabulary and the slicer parses each source
several times per range, which would put this file at minutes. The full
vocabulary is covered by the SmolLM2 (llama) route tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from meshnode.errors import CutRefusedError
from meshnode.gguf.arch import check_cut, swa_layers
from meshnode.gguf.slicer import Role, ensure_range
from tests.archcheck import N_DECODE, PROMPT, Run, assert_same_run, run_chain, run_whole
from tests.conftest import llama_reference
from tests.tinymodels import make_tiny_model

N_LAYER = 12
N_VOCAB = 1024
#: the prompt's 44 tokens (truncated vocabulary) are well past gemma3's window of 8
SLIDING_WINDOW = 8

Cut = Sequence[tuple[int, int]]

CUTS: list[Cut] = [
    [(0, 5), (5, 12)],
    [(0, 1), (1, 11), (11, 12)],
    [(0, 6), (6, 7), (7, 12)],
]
#: gemma3's pattern has period 6: cuts off that grid shift it inside every slice
GEMMA3_CUTS: list[Cut] = [
    *CUTS,
    [(0, 4), (4, 9), (9, 12)],
    [(0, 2), (2, 3), (3, 8), (8, 12)],
    [(0, 11), (11, 12)],
    # slices of only global layers ([5, 6), [11, 12)) and of only local ones ([6, 11))
    [(0, 5), (5, 6), (6, 11), (11, 12)],
]

#: arch name -> make_tiny_model keyword arguments
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "n_head_kv": 4},
    # GQA, rope base 1e6, untied output.weight; quantized matmuls
    "mistral": {"arch": "mistral", "n_head_kv": 1, "weight_type": "Q8_0", "seed": 1},
    "qwen2": {"arch": "qwen2", "seed": 2},
    "qwen3": {"arch": "qwen3", "seed": 3, "token_embd_type": "F32"},
    # n_embd 96: sqrt(n_embd) is not exact in float32, so the head's own scale is tested
    "gemma3": {"arch": "gemma3", "seed": 4, "n_embd": 96, "sliding_window": SLIDING_WINDOW},
}


@pytest.fixture(scope="module")
def tiny(model: Path, tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny(name, **overrides) -> path of a tiny model, built once per module."""
    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def make(name: str, **overrides: Any) -> Path:
        kwargs = {"n_layer": N_LAYER, "n_vocab": N_VOCAB, **VARIANTS.get(name, {}), **overrides}
        key = f"{name}-" + "-".join(f"{k}={kwargs[k]}" for k in sorted(kwargs))
        if key not in built:
            arch = kwargs.pop("arch")
            built[key] = make_tiny_model(root / f"{name}-{len(built)}.gguf", arch, tokenizer_from=model, **kwargs)
        return built[key]

    return make


_whole_runs: dict[Path, Run] = {}


def whole_run(path: Path) -> Run:
    if path not in _whole_runs:
        _whole_runs[path] = run_whole(path)
    return _whole_runs[path]


# -- the whole model is the reference ----------------------------------------


@pytest.mark.parametrize("name", list(VARIANTS))
def test_whole_range_equals_llama(tiny, name):
    """The whole model as one LlamaRange is llama-cpp-python's Llama, bit for bit."""
    path = tiny(name)
    whole = whole_run(path)
    assert len(whole.prompt_tokens) > 2 * SLIDING_WINDOW + 8
    # every step computes something new (a random model may repeat one token; its logits still move)
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(whole.logits))
    ref = llama_reference(path, PROMPT, N_DECODE + 1)
    assert_same_run(whole, Run(ref.prompt_tokens, ref.tokens, ref.logits))


@pytest.mark.parametrize(
    ("name", "cut"),
    [(name, cut) for name in VARIANTS for cut in (GEMMA3_CUTS if name == "gemma3" else CUTS)],
    ids=lambda v: "_".join(f"{a}-{b}" for a, b in v) if isinstance(v, list) else v,
)
def test_cut_equals_whole(tiny, name, cut):
    path = tiny(name)
    assert_same_run(run_chain(path, cut), whole_run(path))


# -- gemma3 specifics -----------------------------------------------------------


def _field(path: Path, key: str) -> Any:
    reader = gguf.GGUFReader(path, "r")
    f = reader.fields.get(key)
    return None if f is None else (f.contents(), f.types)


def _default_flags(n: int) -> list[bool]:
    """llama.cpp's set_swa_pattern(6): every 6th layer global."""
    return [il % 6 < 5 for il in range(n)]


@pytest.mark.parametrize("cut", GEMMA3_CUTS[3:5], ids=str)
def test_gemma3_slices_carry_the_pattern_of_their_layers(tiny, cut):
    path = tiny("gemma3")
    whole_flags = swa_layers({"gemma3.attention.sliding_window": SLIDING_WINDOW}, "gemma3", N_LAYER)
    assert whole_flags == _default_flags(N_LAYER)
    assert _field(path, "gemma3.attention.sliding_window_pattern") is None  # source: llama.cpp's default
    for a, b in cut:
        art = ensure_range(path, a, b)
        value, types = _field(art.range_path, "gemma3.attention.sliding_window_pattern")
        assert types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
        assert value == whole_flags[a:b]
        assert _field(art.range_path, "gemma3.block_count")[0] == b - a
        assert _field(art.range_path, "gemma3.attention.sliding_window")[0] == SLIDING_WINDOW
        assert _field(art.range_path, "gemma3.rope.freq_base_swa")[0] == 10000.0


def test_gemma3_explicit_irregular_pattern_is_sliced_and_exact(tiny):
    """A source with its own per-layer flags: slices carry exactly theirs, and run exactly."""
    flags = [True, False, True, True, False, True, True, True, False, False, True, True]
    path = tiny("gemma3", swa_pattern=flags)
    assert _field(path, "gemma3.attention.sliding_window_pattern")[0] == flags
    cut = [(0, 3), (3, 9), (9, 12)]
    for a, b in cut:
        art = ensure_range(path, a, b)
        assert _field(art.range_path, "gemma3.attention.sliding_window_pattern")[0] == flags[a:b]
    assert_same_run(run_chain(path, cut), whole_run(path))


def test_gemma3_period_pattern_is_sliced_and_exact(tiny):
    """A source declaring a period (4) instead of flags: slices get the flags of that period."""
    path = tiny("gemma3", swa_pattern=4)
    cut = [(0, 5), (5, 10), (10, 12)]
    for a, b in cut:
        art = ensure_range(path, a, b)
        assert _field(art.range_path, "gemma3.attention.sliding_window_pattern")[0] == [
            il % 4 < 3 for il in range(a, b)
        ]
    assert_same_run(run_chain(path, cut), whole_run(path))


def test_gemma3_without_sliding_window_is_exact(tiny):
    path = tiny("gemma3", sliding_window=0)
    cut = [(0, 5), (5, 12)]
    for a, b in cut:
        assert _field(ensure_range(path, a, b).range_path, "gemma3.attention.sliding_window_pattern") is None
    assert_same_run(run_chain(path, cut), whole_run(path))
    # the same weights with the window of 8: the prompt is long enough for the window to matter
    windowed = whole_run(tiny("gemma3"))
    assert windowed.prompt_tokens == whole_run(path).prompt_tokens
    assert not np.array_equal(windowed.logits[0], whole_run(path).logits[0])


def test_gemma3_62_layers_refused_for_partial_cuts_allowed_whole(tiny):
    meta = {"gemma3.block_count": 62, "gemma3.attention.sliding_window": 1024}
    for a, b in [(0, 31), (31, 62), (1, 61)]:
        with pytest.raises(CutRefusedError, match="62 layers"):
            check_cut(meta, "gemma3", 62, a, b)
    assert check_cut(meta, "gemma3", 62, 0, 62).arch == "gemma3"
    # the same through the slicer, on a real (tiny, never run) 62-layer file
    path = tiny("gemma3", n_layer=62, n_embd=64, n_ff=64)
    with pytest.raises(CutRefusedError, match="62 layers"):
        ensure_range(path, 0, 31)
    assert ensure_range(path, 0, 62).role is Role.WHOLE
    # other layer counts of gemma3 are cut
    assert check_cut({**meta, "gemma3.block_count": 26}, "gemma3", 26, 0, 13).swa is not None


@pytest.mark.parametrize("arch", ["bert", "t5", "mamba"])  # loaded by llama.cpp, not in the table
def test_unknown_arch_refused_naming_it(arch):
    meta = {"general.architecture": arch, f"{arch}.block_count": 26}
    with pytest.raises(CutRefusedError, match=repr(arch)):
        check_cut(meta, arch, 26, 0, 13)
    with pytest.raises(CutRefusedError, match=repr(arch)):
        check_cut(meta, arch, 26, 13, 26)
    # whole, it is just the file: allowed
    assert check_cut(meta, arch, 26, 0, 26).arch == arch


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sliding_window_refused_where_not_handled(arch):
    meta = {f"{arch}.block_count": 32, f"{arch}.attention.sliding_window": 4096}
    with pytest.raises(CutRefusedError, match=f"{arch} declares a sliding window"):
        check_cut(meta, arch, 32, 0, 16)
    assert check_cut(meta, arch, 32, 0, 32).arch == arch
    assert check_cut({f"{arch}.block_count": 32}, arch, 32, 0, 16).arch == arch


def test_llama_file_with_sliding_window_refused(tiny):
    path = tiny("llama", extra_kv={"llama.attention.sliding_window": 8})
    with pytest.raises(CutRefusedError, match="sliding window"):
        ensure_range(path, 0, 5)
    assert ensure_range(path, 0, N_LAYER).role is Role.WHOLE


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_boundary_equals_whole(tiny, name):
    """Every one of the 11 boundaries as a 2-hop route, and two 3-hop cuts (issue 22, item 2)."""
    from tests.archcheck import check_every_cut

    assert check_every_cut(tiny(name), three_hop=[CUTS[1], CUTS[2]]) == list(range(1, N_LAYER))
