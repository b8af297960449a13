"""Mixture-of-experts and other llama-like graphs cut exactly, on real llama.cpp (pinned build).

For each architecture of meshnode/gguf/archtable/moe.py a tiny random-weight
model built as its loader reads it (tests/tiny/moe.py) is split at every
boundary into 2 hops and at two points into 3; tokens and logits equal the
whole model's (and llama-cpp-python's ``Llama``) bit for bit:

* qwen3moe (q/k norms, 8 experts, 2 used); qwen2moe (q/k/v biases, 8 experts
  and a shared expert with its sigmoid gate; output.weight required, so
  non-tail slices carry a 1-row stand-in);
* arch ``llama`` with experts (Mixtral: expert_count 8, 2 used, untied
  output.weight) and with Llama 3.1's ``rope_freqs.weight``, which every slice
  carries (and which changes the logits: it is not a no-op);
* mistral3 with yarn and the attention temperature of the position (which
  changes the logits in this prompt);
* command-r (parallel attention/FFN, LayerNorm, logit scale, tied lm_head);
  with >= 64 layers it has q/k norms that only a file of >= 64 layers loads,
  so a 128-layer model is cut only at 64 and every other boundary (and any
  shorter range) is refused with that reason;
* olmo2 without a window, with a window of 8 on llama.cpp's default pattern
  (3 of every 4 layers, global layers under yarn), and with an explicit
  per-layer pattern as Olmo 3 files carry it; slices of only global layers
  included; the window changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from meshnode.errors import CutRefusedError
from meshnode.gguf.arch import check_cut, swa_layers
from meshnode.gguf.meta import read_meta
from meshnode.gguf.slicer import _add_raw, _copy_kv
from tests.archcheck import check_every_cut, run_whole
from tests.tiny import make

THREE_HOP = [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]]
#: olmo2's default pattern on 6 layers: [T, T, T, F, T, T]; [3, 4) holds only its global layer
OLMO2_THREE_HOP = [[(0, 3), (3, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]]
WINDOW = 8
_YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 256}
#: an Olmo 3 file: a window, llama.cpp's default pattern, yarn on the global layers
OLMO3 = {"olmo2.attention.sliding_window": WINDOW, **{f"olmo2.{k}": v for k, v in _YARN.items()}}
#: as Olmo 3 converts (convert_hf_to_gguf: layer_types -> sliding_window_pattern), not the default here
OLMO3_PATTERN = [True, False, True, True, False, True]

#: case -> (builder, spec overrides, three-hop cuts)
CASES: dict[str, tuple[str, dict[str, Any], list[list[tuple[int, int]]]]] = {
    "qwen3moe": ("qwen3moe", {}, THREE_HOP),
    "mixtral": ("mixtral", {}, THREE_HOP),
    "llama31": ("llama31", {}, THREE_HOP),
    "qwen2moe": ("qwen2moe", {}, THREE_HOP),
    "mistral3": ("mistral3", {}, THREE_HOP),
    "command-r": ("command-r", {}, THREE_HOP),
    "olmo2": ("olmo2", {}, THREE_HOP),
    "olmo2-window": ("olmo2", {"extra_kv": OLMO3}, OLMO2_THREE_HOP),
    "olmo2-window-pattern": ("olmo2", {"extra_kv": {**OLMO3, "olmo2.attention.sliding_window_pattern": OLMO3_PATTERN}},
                             [[(0, 1), (1, 2), (2, 6)], [(0, 3), (3, 5), (5, 6)]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_cut_equals_whole(case: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    name, spec, three_hop = CASES[case]
    path = make(tmp_path / f"{case}.gguf", name, tokenizer_from=model, **spec)
    assert check_every_cut(path, three_hop=three_hop) == [1, 2, 3, 4, 5]


def _without_tensor(src: Path, dst: Path, name: str) -> Path:
    """A copy of ``src`` without tensor ``name`` (every other key and tensor unchanged)."""
    meta = read_meta(src, full=True)
    w = gguf.GGUFWriter(dst, meta.fields["general.architecture"])
    _copy_kv(w, meta, ())
    for t in meta.tensors:
        if t.name != name:
            _add_raw(w, src, t.name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _differ(a: Path, b: Path) -> bool:
    ra, rb = run_whole(a), run_whole(b)
    return any(not np.array_equal(x, y) for x, y in zip(ra.logits, rb.logits, strict=True))


def test_features_change_the_logits(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """What the cuts above carry is not a no-op on this prompt: rope_freqs, mistral3's attention
    temperature, olmo2's window (each against the same weights without it)."""
    llama31 = make(tmp_path / "llama31.gguf", "llama31", tokenizer_from=model)
    assert _differ(llama31, _without_tensor(llama31, tmp_path / "llama31-plain.gguf", "rope_freqs.weight"))
    mistral3 = make(tmp_path / "mistral3.gguf", "mistral3", tokenizer_from=model)
    cold = make(tmp_path / "mistral3-t0.gguf", "mistral3", tokenizer_from=model,
                extra_kv={"mistral3.attention.temperature_scale": 0.0})
    assert _differ(mistral3, cold)
    olmo3 = make(tmp_path / "olmo3.gguf", "olmo2", tokenizer_from=model, extra_kv=OLMO3)
    unwindowed = make(tmp_path / "olmo3-w0.gguf", "olmo2", tokenizer_from=model,
                      extra_kv={**OLMO3, "olmo2.attention.sliding_window": 0})
    assert _differ(olmo3, unwindowed)
    flags = swa_layers(read_meta(olmo3, full=True).fields, "olmo2", 6)
    assert flags == [True, True, True, False, True, True]  # load_swa_pattern(ml, 4): set_swa_pattern(4)


def test_command_r_qk_norms_cut_only_into_64_layer_ranges(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """Command R+ style (>= 64 layers, q/k norms): only a cut leaving 64 layers each side is exact."""
    path = make(tmp_path / "command-r-128.gguf", "command-r", tokenizer_from=model, n_layer=128, n_embd=32,
                n_ff=64)
    assert check_every_cut(path) == [64]
    # the range rule: boundaries both allowed, but a range shorter than 64 layers
    meta = {"command-r.block_count": 200}
    check_cut(meta, "command-r", 200, 100, 200)
    with pytest.raises(CutRefusedError, match=r"layers 64:100: command-r creates its q/k norms only"):
        check_cut(meta, "command-r", 200, 64, 100)
