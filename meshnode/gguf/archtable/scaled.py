"""Graphs that scale their input: granite, granitemoe (embedding_scale), gemma2 (sqrt(n_embd)); phi3."""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, Refused

ENTRIES: list[ArchPolicy] = []

REFUSED: list[Refused] = []
