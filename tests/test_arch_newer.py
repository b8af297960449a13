"""2026's families cut exactly, and every other architecture the pinned build loads accounted for.

gemma4: every boundary the policy allows into 2 hops and two cuts into 3, bit-identical to the
whole model; its refused boundaries (1-layer slices, slices without a global or a local layer,
KV-sharing layers, per-layer embeddings) refused with their reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnode.errors import CacheMissError
from meshnode.executor._llama import LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.gguf.slicer import ensure_range
from tests.archcheck import check_every_cut
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
