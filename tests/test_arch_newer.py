"""2026's families cut exactly, and every other architecture the pinned build loads accounted for.

gemma4 (31B-, 26B-A4B-, KV-sharing and E2B-shaped tiny models) and qwen3next (hybrid gated
delta-net + attention, with explicit recurrent_layers and with only full_attention_interval):
every boundary the policy allows into 2 hops and two cuts into 3, bit-identical (tokens and
logits) to the whole model, which equals llama-cpp-python's Llama; every refused boundary (gemma4:
1-layer slices, slices without a global or a local layer, KV-sharing layers, per-layer
embeddings; qwen3next: slices without an attention or a delta-net layer) refused with its reason.
A hybrid hop refuses to roll back (typed CacheMissError) and a replay from 0 rebuilds its state.
Every architecture llama-arch.cpp names is exact or refused with a reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from meshnode.errors import CacheMissError, CutRefusedError
from meshnode.executor._llama import LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.gguf import archtable
from meshnode.gguf.arch import boundary_verdicts, check_cut, policy_for
from meshnode.gguf.archtable import newer
from meshnode.gguf.slicer import ensure_range
from tests.archcheck import check_every_cut, run_whole
from tests.tiny import make

GEMMA4_3HOP = [[(0, 3), (3, 6), (6, 8)], [(0, 4), (4, 6), (6, 8)]]


@pytest.mark.parametrize(("name", "three_hop", "cuttable"), [
    ("gemma4", GEMMA4_3HOP, [3, 4, 5, 6]),
    ("gemma4-moe", GEMMA4_3HOP, [3, 4, 5, 6]),
    ("gemma4-shared-kv", [], [3, 4]),
    ("gemma4-ple", [], []),
])
def test_gemma4_every_cut_equals_whole(name: str, three_hop: list, cuttable: list[int], model: Path,
                                       tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / f"{name}.gguf", name, tokenizer_from=model)
    assert check_every_cut(path, three_hop=three_hop) == cuttable


@pytest.mark.parametrize("name", ["qwen3next", "qwen3next-interval"])
def test_qwen3next_every_cut_equals_whole(name: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / f"{name}.gguf", name, tokenizer_from=model)
    cut = check_every_cut(path, three_hop=[[(0, 3), (3, 6), (6, 9)], [(0, 4), (4, 7), (7, 9)]])
    assert cut == [3, 4, 5, 6, 7]


def test_qwen3next_rollback_is_refused_and_replay_rebuilds(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """A hybrid hop cannot drop positions from the end of its recurrent state (llama.cpp's
    ``llama_memory_recurrent::seq_rm`` returns false for 0 < p0): ``truncate`` says so with a
    typed CacheMissError and clears the sequence; a replay from position 0 then computes the
    very same residual (failover replay works, rolling back a position does not)."""
    path = make(tmp_path / "qwen3next.gguf", "qwen3next", tokenizer_from=model)
    art = ensure_range(path, 0, 4)
    r = LlamaRange(art, ExecConfig())
    try:
        toks = np.arange(1, 13, dtype=np.int32)
        first = r.forward(0, 0, tokens=toks).residual
        r.truncate(0, len(toks))  # resuming exactly where the hop is needs no rollback
        assert r.next_pos(0) == len(toks)
        with pytest.raises(CacheMissError, match="recurrent state"):
            r.truncate(0, 10)
        assert r.next_pos(0) == 0
        again = r.forward(0, 0, tokens=toks).residual
        assert first is not None
        assert again is not None
        assert np.array_equal(first, again)
        r.release(0)
        assert r.next_pos(0) == 0
    finally:
        r.close()


#: every architecture the pinned build names: the values of ``LLM_ARCH_NAMES`` in
#: vendor/llama.cpp/src/llama-arch.cpp of llama-cpp-python 0.3.36, in its order, less "(unknown)"
#: (extracted with: sed -n '/LLM_ARCH_NAMES = {/,/^};/p' llama-arch.cpp | grep -o '"[^"]*"')
PINNED_ARCHS = """
    clip llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
    nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2 qwen2moe
    qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe qwen4exp phi2 phi3 phimoe plamo
    plamo2 plamo3 codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 gemma3n gemma4
    gemma4-assistant gemma-embedding starcoder2 mamba mamba2 maple jamba falcon-h1 xverse command-r cohere2
    cohere2moe dbrx olmo olmo2 olmoe muse-glimmer openelm arctic deepseek deepseek2 deepseek2-ocr deepseek32
    deepseek4 chatglm glm4 glm4moe glm-dsa bitnet t5 t5encoder jais jais2 nemotron nemotron_h nemotron_h_moe
    exaone exaone4 exaone-moe rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite granitemoe granitehybrid graniteswitch
    granite_swa chameleon wavtokenizer-dec plm bailingmoe bailingmoe2 bailingmoe3 dots1 dots3note arcee
    afmoe laguna ernie4_5 ernie4_5-moe hunyuan-moe hunyuan-dense hunyuan_vl hy_v3 hy_v4 smollm3 gpt-oss lfm2
    lfm2moe dream smallthinker llada llada-moe seed_oss grovemoe apertus minimax-01 hrm_text minimax-m2
    minimax-m3 cogvlm rnd1 pangu-embedded mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35 spark2_5
    llama-embed maincoder kimi-linear kimi-k3 glm5-next talkie mellum nanbeige qwen3tts pockettts
""".split()

#: the architectures the other families own (they appear in the table as those families finish)
OTHER_FAMILIES = {
    "dense": {"llama", "qwen2", "qwen3", "gemma3"},
    "moe": {"qwen3moe", "qwen2moe", "mistral3", "command-r", "olmo2"},
    "scaled": {"granite", "granitemoe", "gemma2", "phi3"},
    "windowed": {"cohere2", "gpt-oss", "llama4"},
    "deepseek": {"deepseek2", "glm4moe"},
}


def test_every_pinned_architecture_is_exact_or_refused() -> None:
    """Each name llama.cpp knows is in exactly one of POLICIES (cut exactly) and REFUSED (with a
    reason); only names another family owns may still be missing while it works."""
    assert len(PINNED_ARCHS) == 153
    assert len(set(PINNED_ARCHS)) == 153
    pending = set().union(*OTHER_FAMILIES.values())
    assert pending <= set(PINNED_ARCHS)
    both = set(archtable.POLICIES) & set(archtable.REFUSED)
    assert not both, f"both exact and refused: {sorted(both)}"
    missing = [a for a in PINNED_ARCHS if a not in archtable.POLICIES and a not in archtable.REFUSED]
    assert set(missing) <= pending, f"neither exact nor refused: {sorted(set(missing) - pending)}"
    unknown = (set(archtable.POLICIES) | set(archtable.REFUSED)) - set(PINNED_ARCHS)
    assert not unknown, f"not an architecture of the pinned build: {sorted(unknown)}"
    for r in archtable.REFUSED.values():
        assert r.reason, r.arch
        assert r.source, r.arch
    for p in newer.ENTRIES:
        assert p.source, p.arch
        assert p.note, p.arch
        assert p.families, p.arch
        assert p.test == "tests/test_arch_newer.py", p.arch


def test_refused_architectures_say_why() -> None:
    """A refused architecture still runs whole; a cut of it names the reason."""
    for arch in ("qwen3vl", "mamba", "kimi-linear", "deepseek32", "gemma3n"):
        with pytest.raises(CutRefusedError, match=re.escape(archtable.REFUSED[arch].reason[:40])):
            policy_for(arch)
        meta = {f"{arch}.block_count": 4}
        assert boundary_verdicts(meta, arch, 4).cuttable == []
        check_cut(meta, arch, 4, 0, 4)  # the whole model is the file itself


def test_gemma4_window_matters(model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    """The tiny gemma4's local layers see fewer tokens than the prompt: without the window it computes otherwise."""
    windowed = run_whole(make(tmp_path / "w.gguf", "gemma4", tokenizer_from=model))
    wide = run_whole(make(tmp_path / "n.gguf", "gemma4", tokenizer_from=model,
                          extra_kv={"gemma4.attention.sliding_window": 4096}))
    assert len(windowed.prompt_tokens) > 8
    assert not np.array_equal(windowed.logits[0], wide.logits[0])
