"""Token sampling at the tail: pure functions of logits (and an RNG)."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from meshnode import errors


def check_sampling(*, temperature: float, top_p: float) -> None:
    """Refuse settings ``sample`` cannot honour (InputError): a temperature that is not a finite
    number (<= 0 means greedy), a top_p outside [0, 1] (0 and 1 mean no nucleus cut)."""
    if not math.isfinite(temperature):
        raise errors.InputError(f"temperature {temperature} is not a finite number")
    if not (math.isfinite(top_p) and 0.0 <= top_p <= 1.0):
        raise errors.InputError(f"top_p {top_p} is not within [0, 1]")


def greedy(logits: npt.NDArray[np.float32]) -> int:
    """argmax, first maximum on ties — as llama.cpp's greedy sampler."""
    return int(np.argmax(logits))


def sample(logits: npt.NDArray[np.float32], *, temperature: float, top_k: int, top_p: float,
           rng: np.random.Generator) -> int:
    if temperature <= 0.0:
        return greedy(logits)
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    z = x[order] - x[order[0]]
    p = np.exp(z)
    p /= p.sum()
    if 0.0 < top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])
