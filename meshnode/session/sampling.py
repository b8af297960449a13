"""Sampling settings: checked at every edge, carried on the wire, drawn when not given.

The sampler itself is llama.cpp's chain (``meshnode.executor.sampler.Chain``), built as
llama-cpp-python's ``Llama`` builds it; this module holds what a generation asks of it:

* ``SamplingParams()`` are ``Llama.create_completion``'s defaults (temperature 0.8, top_k 40,
  top_p 0.95, min_p 0.05, typical_p 1, no penalties); ``GREEDY`` is temperature 0.
* ``check_sampling`` refuses what llama.cpp cannot honour or would not repeat, as one-line
  ``InputError``s naming the flag (a hop checks every open with it; the CLI every flag).
* ``to_pb``/``from_pb``: ``Sampling`` on the wire (node.proto: unset fields have no effect).
* ``random_seed``: a run at temperature > 0 without a seed gets one from ``secrets`` and
  reports it, so that it can be repeated.
"""

from __future__ import annotations

import dataclasses
import math
import secrets

from meshnode import errors
from meshnode.executor.sampler import RANDOM_SEED, SamplingParams
from meshnode.proto import node_pb2 as pb

__all__ = ["GREEDY", "MAX_STOPS", "MAX_STOP_BYTES", "SamplingParams", "check_sampling", "check_stops",
           "from_pb", "random_seed", "to_pb", "with_seed"]

#: greedy decoding (argmax): the default of programmatic callers (GenerateConfig), reproducible
GREEDY = SamplingParams(temperature=0.0)
#: llama.cpp's top_k and penalty_last_n are int32
INT32_MAX = 2**31 - 1
#: stop strings a generation may give (OpenAI allows 4; llama-server any)
MAX_STOPS = 16
#: bytes of one stop string (UTF-8)
MAX_STOP_BYTES = 256


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise errors.InputError(f"{name} must be a finite number, not {value}")


def _unit(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise errors.InputError(f"{name} must be within [0, 1], not {value}")


def check_sampling(p: SamplingParams) -> None:
    """Refuse settings llama.cpp's chain cannot honour or that could not be repeated (InputError)."""
    if not (math.isfinite(p.temperature) and p.temperature >= 0.0):
        raise errors.InputError(f"temperature must be a finite number >= 0 (0 = greedy), not {p.temperature}")
    if not 0 <= p.top_k <= INT32_MAX:
        raise errors.InputError(f"top_k must be within 0..{INT32_MAX} (0 = off), not {p.top_k}")
    for name in ("top_p", "min_p", "typical_p"):
        _unit(name, getattr(p, name))
    if not (math.isfinite(p.repeat_penalty) and p.repeat_penalty > 0.0):
        raise errors.InputError(f"repeat_penalty must be a finite number > 0 (1 = off), not {p.repeat_penalty}")
    _finite("frequency_penalty", p.frequency_penalty)
    _finite("presence_penalty", p.presence_penalty)
    if not 0 <= p.penalty_last_n <= INT32_MAX:
        raise errors.InputError(f"penalty_last_n must be within 0..{INT32_MAX}, not {p.penalty_last_n}")
    if not 0 <= p.seed < RANDOM_SEED:
        raise errors.InputError(f"seed must be within 0..{RANDOM_SEED - 1}, not {p.seed}")


def check_stops(stops: tuple[str, ...]) -> None:
    """Stop strings: at most MAX_STOPS, each non-empty and at most MAX_STOP_BYTES of UTF-8."""
    if len(stops) > MAX_STOPS:
        raise errors.InputError(f"at most {MAX_STOPS} stop strings, not {len(stops)}")
    for s in stops:
        if not s:
            raise errors.InputError("a stop string must not be empty")
        try:
            n = len(s.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise errors.InputError(f"stop string {s!r} is not valid text: {e.reason}") from None
        if n > MAX_STOP_BYTES:
            raise errors.InputError(f"a stop string may have at most {MAX_STOP_BYTES} bytes, not {n}")


def random_seed() -> int:
    """A fresh seed the dist sampler repeats exactly (never LLAMA_DEFAULT_SEED, its 'random')."""
    return secrets.randbelow(RANDOM_SEED)


def to_pb(p: SamplingParams) -> pb.Sampling:
    """Every field explicitly, so that the hop needs no defaults of its own."""
    return pb.Sampling(temperature=p.temperature, seed=p.seed, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                       typical_p=p.typical_p, repeat_penalty=p.repeat_penalty,
                       frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                       penalty_last_n=p.penalty_last_n)


def from_pb(s: pb.Sampling) -> SamplingParams:
    """The settings an open asks for, checked (InputError); an unset field has no effect."""
    p = SamplingParams(
        temperature=s.temperature, seed=s.seed, top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0, min_p=s.min_p,
        typical_p=s.typical_p if s.HasField("typical_p") else 1.0,
        repeat_penalty=s.repeat_penalty if s.HasField("repeat_penalty") else 1.0,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        penalty_last_n=s.penalty_last_n if s.HasField("penalty_last_n") else SamplingParams.penalty_last_n,
    )
    check_sampling(p)
    return p


def with_seed(p: SamplingParams, seed: int | None) -> tuple[SamplingParams, bool]:
    """``p`` with ``seed``, or with a fresh random one when sampling without one (True: it was drawn)."""
    if seed is not None:
        return dataclasses.replace(p, seed=seed), False
    if p.temperature > 0.0:
        return dataclasses.replace(p, seed=random_seed()), True
    return p, False
