"""Mixture-of-experts graphs cut exactly: every boundary into 2 hops, two cuts into 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.archcheck import check_every_cut
from tests.tiny import make

CASES = {
    "qwen3moe": {},
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_cut_equals_whole(name: str, model: Path, tiny_cache: Path, tmp_path: Path) -> None:
    path = make(tmp_path / f"{name}.gguf", name, tokenizer_from=model, **CASES[name])
    cut = check_every_cut(path, three_hop=[[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)]])
    assert cut == [1, 2, 3, 4, 5]
