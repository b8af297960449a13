"""deepseek2 and glm4moe cut exactly: leading dense blocks, MLA, next-token-prediction blocks.

What this proves, on real llama.cpp against llama-cpp-python's ``Llama``:

* deepseek2 (models/deepseek2.cpp), MLA with split ``attn_k_b``/``attn_v_b``:
  a DeepSeek-V3-like model (``q_lora_rank``, 2 leading dense blocks, sigmoid
  gating with ``exp_probs_b``, expert groups, YaRN, one MTP block) and the
  ``attn_q`` path (``q_lora_rank = 0``) are bit-identical to the whole model cut
  at every boundary into 2 hops and at two 3-hop cuts. A 27-layer lite model
  (no ``q_lora_rank`` key: llama.cpp's ``is_lite`` comes from the layer count) is
  exact cut into slices that are not lite-sized, because each slice states
  ``q_lora_rank = 0``; without that statement llama.cpp cannot load them. A
  lite-sized slice (26/27 layers; 48 for a 128256-token tail) of a
  ``q_lora_rank`` model is refused; forced, llama.cpp cannot load it. A
  missing ``expert_gating_func`` is stated as the whole model resolves it.
* glm4moe (models/glm4-moe.cpp): GLM-4.5-like (q/k norms, 2 dense blocks) and
  GLM-4.5-Air-like (no q/k norms, 1 dense block) models with an MTP block are
  exact at every cut. The graph aborts on embeddings input unless M-RoPE is in
  use; every slice declares M-RoPE sections with equal position rows, which is
  NEOX RoPE bit for bit (shown by the cuts; without the sections the hop
  aborts, shown in a subprocess). A file that uses M-RoPE itself (GLM-4.5V's
  text model) keeps its sections and is exact too.
* Next-token-prediction blocks are in no slice (no ``nextn`` tensor, no
  ``nextn_predict_layers``), ``inspect_model`` counts the trunk, and every
  slice's ``leading_dense_block_count`` is its own share of the dense blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshnode.errors import CutRefusedError
from meshnode.gguf.arch import boundary_verdicts, check_cut, slice_kv
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import inspect_model
from meshnode.gguf.slicer import ensure_range
from tests.archcheck import assert_same_run, check_every_cut, check_whole, run_chain
from tests.tiny import make

THREE_HOP = [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]]

#: builder -> the trunk's leading dense blocks and MTP blocks
CASES = {
    "deepseek2": (2, 1),
    "deepseek2-wq": (1, 0),
    "glm4moe": (2, 1),
    "glm4moe-air": (1, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_cut_equals_whole(name: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / f"{name}.gguf", name, tokenizer_from=model)
    info = inspect_model(path)
    dense, nextn = CASES[name]
    meta = read_meta(path).fields
    assert info.n_layer == 6 == int(meta[f"{info.arch}.block_count"]) - nextn
    assert check_every_cut(path, three_hop=THREE_HOP) == [1, 2, 3, 4, 5]
    for a, b in [(0, 1), (0, 3), (1, 5), (3, 6)]:
        art = ensure_range(path, a, b)
        sliced = read_meta(art.range_path)
        assert sliced.fields[f"{info.arch}.block_count"] == b - a
        assert f"{info.arch}.nextn_predict_layers" not in sliced.fields
        assert not [t.name for t in sliced.tensors if ".nextn." in t.name]
        assert sliced.fields[f"{info.arch}.leading_dense_block_count"] == min(max(dense - a, 0), b - a)
        if info.arch == "glm4moe":  # the M-RoPE stand-in that lets the graph take embeddings
            assert sliced.fields["glm4moe.rope.dimension_sections"] == [1, 1, 0, 0]


def _forced(tmp_path: Path, arch: str, field: str, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a subprocess where ``arch``'s policy lacks ``field`` (a rule forced off), with
    its own range cache; llama.cpp's messages (or its abort) come back in stderr."""
    script = textwrap.dedent(f"""
        import dataclasses
        from pathlib import Path
        from meshnode.gguf import archtable
        from meshnode.gguf.slicer import ensure_range
        from meshnode.executor._llama import LlamaRange
        from meshnode.executor.config import ExecConfig
        from tests.archcheck import run_chain
        archtable.POLICIES[{arch!r}] = dataclasses.replace(archtable.POLICIES[{arch!r}], {field}=None)
    """) + textwrap.dedent(body)
    env = {**os.environ, "MESHNODE_CACHE_DIR": str(tmp_path / "forced-cache"), "GGML_NO_BACKTRACE": "1"}
    return subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def test_glm4moe_without_mrope_sections_aborts(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """The reason for the stand-in: glm4-moe.cpp ``if (ubatch.embd && !use_mrope) GGML_ABORT(...)``."""
    path = make(tmp_path / "glm4moe.gguf", "glm4moe", tokenizer_from=model)
    proc = _forced(tmp_path, "glm4moe", "resolved_kv", f"""
        run_chain(Path({str(path)!r}), [(0, 3), (3, 6)])
        print("ran")
    """)
    assert proc.returncode != 0
    assert "This GGUF does not support multimodal" in proc.stderr
    assert "ran" not in proc.stdout


def test_glm4moe_with_its_own_mrope_sections(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """A glm4moe file that uses M-RoPE itself (GLM-4.5V/4.6V's text model): slices keep its
    sections; the whole model's token positions become [p, p, p, 0], as the executor's rows."""
    sections = [2, 3, 3, 0]  # 8 rotated pairs (rope.dimension_count 16), as GLM-4.5V's [8, 12, 12, 0]
    path = make(tmp_path / "glm4moe-v.gguf", "glm4moe", tokenizer_from=model, seed=2,
                extra_kv={"glm4moe.rope.dimension_sections": sections})
    whole = check_whole(path)
    for cut in ([(0, 3), (3, 6)], THREE_HOP[1]):
        assert_same_run(run_chain(path, cut), whole)
    sliced = read_meta(ensure_range(path, 3, 6).range_path)
    assert sliced.fields["glm4moe.rope.dimension_sections"] == sections


def test_deepseek2_lite_slices_state_q_lora_rank(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """A 27-layer model is lite in llama.cpp whatever its keys: it never reads q_lora_rank. Its
    slices are not lite-sized (except 26 layers) and would require it: they state 0."""
    path = make(tmp_path / "lite.gguf", "deepseek2-lite", tokenizer_from=model)
    meta = read_meta(path, full=True).fields
    assert "deepseek2.attention.q_lora_rank" not in meta
    assert boundary_verdicts(meta, "deepseek2", 27).cuttable == list(range(1, 27))
    whole = check_whole(path)
    for cut in ([(0, 13), (13, 27)], [(0, 1), (1, 27)], [(0, 26), (26, 27)], [(0, 9), (9, 18), (18, 27)]):
        assert_same_run(run_chain(path, cut), whole)
    sliced = read_meta(ensure_range(path, 0, 13).range_path).fields
    assert sliced["deepseek2.attention.q_lora_rank"] == 0
    assert sliced["deepseek2.expert_gating_func"] == 1  # SOFTMAX, the whole model's default
    # without the statement an 18-layer slice is not lite and lacks the key llama.cpp then requires
    proc = _forced(tmp_path, "deepseek2", "resolved_kv", f"""
        LlamaRange(ensure_range(Path({str(path)!r}), 2, 20), ExecConfig())
    """)
    assert "ModelFormatError" in proc.stderr
    assert "key not found in model: deepseek2.attention.q_lora_rank" in proc.stderr


def test_deepseek2_lite_sized_slices_of_a_q_lora_model_are_refused(model: Path, tiny_cache: Path,
                                                                   tmp_path: Path) -> None:
    path = make(tmp_path / "ds28.gguf", "deepseek2", tokenizer_from=model, n_layer=28)
    meta = read_meta(path, full=True).fields
    assert inspect_model(path).n_layer == 28
    assert boundary_verdicts(meta, "deepseek2", 28).cuttable == list(range(1, 28))  # a range rule
    for a, b in [(0, 26), (0, 27), (1, 28), (2, 28), (1, 27)]:
        with pytest.raises(CutRefusedError, match=f"{b - a}-layer deepseek2 model for 'lite'"):
            ensure_range(path, a, b)
    for a, b in [(0, 25), (3, 28), (0, 28)]:
        check_cut(meta, "deepseek2", 28, a, b)
    # forced, the 27-layer tail looks for attn_q, which a q_lora_rank model does not have
    proc = _forced(tmp_path, "deepseek2", "range_rule", f"""
        LlamaRange(ensure_range(Path({str(path)!r}), 1, 28), ExecConfig())
    """)
    assert "ModelFormatError" in proc.stderr
    assert "tensor 'blk.0.attn_q.weight' not found" in proc.stderr


def _meta(n_layer: int, n_vocab: int, **kv: object) -> dict[str, object]:
    return {"general.architecture": "deepseek2", "deepseek2.block_count": n_layer,
            "deepseek2.vocab_size": n_vocab, **{f"deepseek2.{k}": v for k, v in kv.items()}}


def test_deepseek2_rules_at_real_sizes() -> None:
    """Pure decisions at the sizes of real files (no model built)."""
    v3 = _meta(61, 129280, **{"attention.q_lora_rank": 1536, "expert_gating_func": 2})
    check_cut(v3, "deepseek2", 61, 0, 30)
    for a, b in [(0, 27), (34, 61), (10, 36)]:
        with pytest.raises(CutRefusedError, match="lite"):
            check_cut(v3, "deepseek2", 61, a, b)
    # 48 layers are lite only with a 128256-token vocabulary, which only a tail carries
    kimi_like = _meta(61, 128256, **{"attention.q_lora_rank": 1536, "expert_gating_func": 2})
    check_cut(kimi_like, "deepseek2", 61, 0, 48)
    with pytest.raises(CutRefusedError, match="48-layer"):
        check_cut(kimi_like, "deepseek2", 61, 13, 61)
    check_cut(v3, "deepseek2", 61, 13, 61)
    # a model whose q_lora_rank is 0 takes the attn_q path at any size: nothing to refuse
    check_cut(_meta(61, 129280, **{"attention.q_lora_rank": 0}), "deepseek2", 61, 0, 27)
    # the gating function a file leaves out, as the whole model resolves it
    glm_flash = _meta(48, 154880, **{"attention.q_lora_rank": 768, "nextn_predict_layers": 1})
    put, drop = slice_kv(glm_flash, "deepseek2", 47, 0, 20, head=True)
    assert put["deepseek2.expert_gating_func"] == 2
    assert "deepseek2.nextn_predict_layers" in drop
    assert "deepseek2.attention.q_lora_rank" not in put
    v2 = _meta(60, 102400, **{"attention.q_lora_rank": 1536})
    assert slice_kv(v2, "deepseek2", 60, 13, 60, head=False)[0]["deepseek2.expert_gating_func"] == 1
    assert "deepseek2.expert_gating_func" not in slice_kv(v3, "deepseek2", 61, 0, 20, head=True)[0]
    # a 48-layer lite model (128256 tokens): its slices state q_lora_rank = 0
    kanana = _meta(48, 128256)
    assert slice_kv(kanana, "deepseek2", 48, 0, 20, head=True)[0]["deepseek2.attention.q_lora_rank"] == 0
