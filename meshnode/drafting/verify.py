"""Which drafted tokens stand: the exact-sampling acceptance rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    #: the drafted tokens accepted, in order (a prefix of the draft)
    accepted: tuple[int, ...]
    #: the token that follows them: the tail's sample at the first rejected position (or after the
    #: last draft when all were accepted)
    next_token: int

    @property
    def tokens(self) -> tuple[int, ...]:
        """What the text gains this round: the accepted drafts and the next token."""
        return (*self.accepted, self.next_token)


def accept(draft: Sequence[int], sampled: Sequence[int]) -> Verdict:
    """``sampled[i]`` is the tail's token at drafted position i, sampled as if ``draft[:i]`` had been
    generated one by one (the same chain, the same random state): so draft i stands iff it equals
    ``sampled[i]``, and the first sample that differs is the text's next token. ``sampled`` has one
    entry more than the drafts it covers (the position after the last draft); the tail may stop
    sampling at the first mismatch, so it can be shorter than ``len(draft) + 1``.
    """
    if not sampled:
        raise ValueError("no sampled token to verify the draft against")
    n = 0
    while n < len(draft) and n < len(sampled) - 1 and draft[n] == sampled[n]:
        n += 1
    return Verdict(tuple(draft[:n]), sampled[n])
