"""Speculative decoding's pure decisions (meshnode/drafting): prompt lookup, the acceptance rule,
the draft length. A drafting loop over a deterministic stand-in model gives exactly the text of
decoding one token at a time, whatever the drafts are."""

from __future__ import annotations

import hashlib
import random

import pytest

from meshnode.drafting import DraftLength, Verdict, accept, propose


def test_propose_continues_the_latest_occurrence_of_the_longest_ngram() -> None:
    text = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the trigram (1 2 3) occurred at 0: what followed it
    assert propose(text, 4) == [4, 5, 9, 2]
    assert propose(text, 2) == [4, 5]
    # the bigram (2 3) occurs at 1 and 6; (9 2 3) never: with max_n=2 the latest (6) wins
    assert propose([*text[:-3], 2, 3], 3, max_n=2) == [7, 8, 2]
    assert propose([5, 6, 7], 4) == []  # nothing repeats
    assert propose([], 4) == []
    assert propose([3, 3], 4) == [3]
    assert propose(text, 0) == []
    assert propose(text, 4, min_n=2, max_n=1) == []


def test_propose_on_a_copy_task_drafts_the_copied_text() -> None:
    paragraph = list(range(100, 140))
    history = [*paragraph, 1, 2, *paragraph[:10]]  # "copy this paragraph": 10 tokens copied so far
    assert propose(history, 8) == paragraph[10:18]


def test_accept_takes_the_prefix_that_matches_then_the_sample() -> None:
    assert accept([5, 6, 7], [5, 6, 7, 8]) == Verdict((5, 6, 7), 8)
    assert accept([5, 6, 7], [5, 9]) == Verdict((5,), 9)
    assert accept([5, 6, 7], [4, 6, 7, 8]) == Verdict((), 4)
    assert accept([], [3]) == Verdict((), 3)
    assert accept([5, 6], [5, 6, 1]).tokens == (5, 6, 1)
    with pytest.raises(ValueError, match="no sampled token"):
        accept([1], [])


def _model(seed: int, vocab: int) -> object:
    """A deterministic next-token function of the whole history, with some repetition in it."""
    def next_token(history: tuple[int, ...]) -> int:
        if len(history) > 6 and history[-1] % 3 == 0:
            return history[-5]  # copies itself now and then, so drafts are sometimes right
        h = hashlib.sha256(f"{seed}:{history[-4:]}".encode()).digest()
        return h[0] % vocab
    return next_token


@pytest.mark.parametrize("seed", range(6))
def test_drafting_loop_equals_one_token_at_a_time(seed: int) -> None:
    f = _model(seed, vocab=7)
    prompt = tuple(random.Random(seed).randrange(7) for _ in range(12))
    want = list(prompt)
    for _ in range(80):
        want.append(f(tuple(want)))
    got, length, rounds = list(prompt), DraftLength(most=8), 0
    rng = random.Random(seed)
    while len(got) < len(want):
        k = length.next()
        draft = propose(got, k) if rng.random() < 0.8 else [rng.randrange(7) for _ in range(k)]
        sampled = []
        for i in range(len(draft) + 1):  # the tail: one sample per position, stopping at a mismatch
            sampled.append(f(tuple(got) + tuple(draft[:i])))
            if i < len(draft) and sampled[-1] != draft[i]:
                break
        v = accept(draft, sampled)
        length.update(len(draft), len(v.accepted))
        got.extend(v.tokens)
        rounds += 1
    assert got[: len(want)] == want
    assert rounds < len(want) - len(prompt)  # drafting saved rounds


def test_draft_length_grows_shrinks_and_rests() -> None:
    d = DraftLength(most=8, least=1, patience=2)
    assert d.next() == 8
    d.update(8, 8)
    assert d.next() == 8  # capped at most
    d.update(8, 3)
    assert d.next() == 4
    d.update(4, 4)
    assert d.next() == 8
    d.update(8, 0)
    assert d.next() == 4
    d.update(4, 0)  # two misses in a row: rest
    assert [d.next() for _ in range(3)] == [0, 1, 0]
    d.update(1, 1)  # the probe stood: back to drafting, from the length before the rest, doubled
    assert d.next() == 4
    d.update(0, 0)  # nothing to draft: a miss
    d.update(0, 0)
    assert d.next() == 0  # resting
    d.wake()  # the caller decoded a stretch on its own: try again at once
    assert d.next() == 1
    with pytest.raises(ValueError, match="least <= most"):
        DraftLength(most=0)


def test_routes_of_recurrent_models_do_not_draft() -> None:
    """A hybrid's recurrent layers cannot drop a rejected draft's positions: such a route decodes
    without drafting (the same text either way)."""
    from meshnode.drafting import can_draft

    assert can_draft(["llama", "llama"])
    assert can_draft(["qwen3moe"])
    assert not can_draft(["qwen3next", "qwen3next"])
    assert can_draft(["an-unknown-arch"])
