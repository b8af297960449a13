"""Prompt lookup: draft the continuation of the last n-gram's most recent earlier occurrence."""

from __future__ import annotations

from collections.abc import Sequence


def propose(history: Sequence[int], k: int, *, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of ``history``'s last
    n tokens, for the longest n in ``max_n`` .. ``min_n`` that occurs; [] if none does.

    ``history`` is the prompt and the text generated so far. Longer n-grams first: they predict
    better; the most recent occurrence first: text repeats what it said last. Pure, O(len * n).
    """
    if k <= 0 or min_n < 1 or max_n < min_n:
        return []
    toks = list(history)
    size = len(toks)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = toks[size - n:]
        # an occurrence ending before the tail's own start, latest first, with something after it
        for start in range(size - n - 1, -1, -1):
            if toks[start:start + n] == tail:
                follow = toks[start + n:start + n + k]
                if follow:
                    return follow
    return []
