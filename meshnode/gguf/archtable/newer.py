"""2026's families and hybrids (gemma4, qwen3next, ...), and every other architecture the pinned build loads."""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, Refused

ENTRIES: list[ArchPolicy] = []

REFUSED: list[Refused] = []
