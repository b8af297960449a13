"""A hop's side of a draft step (speculative decoding; docs/protocol.md, "Drafts").

A draft step carries the last sampled token and K drafted ones. Every hop computes the K + 1
positions one at a time, each as the single-token step it would be without drafting: on this
llama.cpp build a batch of positions does not give bit-identical rows (measured on SmolLM2:
logits up to 0.55 apart), and the route must equal decoding one token at a time. A non-tail hop
sends the K + 1 rows on as one activation; the tail samples position 0, and position i + 1 only
while its sample at i equalled draft token i + 1 (the chain draws once per sample, so its state is
what it would be without drafting). The tail computes no position past the first rejected one;
the other hops drop theirs when the next step's ``CacheExpectation`` says how many stood
(``rollback_to``).

Pure decisions here (``check_draft``, ``stands``, ``rollback_to``); the hop (hop.py) does the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnode import errors


def check_draft(n_tokens: int, draft: int, n_rows: int | None, *, most: int) -> None:
    """A draft step's shape: ``draft`` + 1 token ids (every hop gets them) and, past the head, as many
    residual rows; at most ``most`` positions (the negotiated prefill chunk)."""
    if draft < 1:
        raise errors.ShapeError("a draft step drafts at least one token")
    if n_tokens != draft + 1:
        raise errors.ShapeError(f"a draft step of {draft} drafted tokens carries {draft + 1} token ids, not {n_tokens}")
    if n_rows is not None and n_rows != draft + 1:
        raise errors.ShapeError(f"a draft step of {draft + 1} positions carries {n_rows} residual rows")
    if draft + 1 > most:
        raise errors.ShapeError(f"a draft step of {draft + 1} positions exceeds the negotiated {most}")


def stands(i: int, sampled: int, tokens: Sequence[int], eog: bool) -> bool:
    """After sampling ``sampled`` at position i of a draft step whose ids are ``tokens``: whether the
    tail goes on to position i + 1 (the sample is the next drafted token, and no end of generation)."""
    return not eog and i + 1 < len(tokens) and sampled == tokens[i + 1]


def rollback_to(expected: int, holds: int, floor: int | None) -> bool:
    """Whether a non-tail hop holding ``holds`` positions drops to the ``expected`` a step names: only
    positions its last draft step added (``floor``: that step's first position + 1) may go."""
    return floor is not None and floor <= expected < holds
