"""llama.cpp's own sampler chain, as llama-cpp-python's ``Llama`` builds it: bindings -> owning wrapper.

Layer 1 is llama-cpp-python's ctypes layer (``llama_cpp.llama_cpp.llama_sampler_*``); the C
side it relies on (llama.h of the llama.cpp that llama-cpp-python 0.3.36 vendors)::

    struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
    void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);  // takes ownership
    void llama_sampler_apply (struct llama_sampler * smpl, llama_token_data_array * cur_p);
    void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
    void llama_sampler_free  (struct llama_sampler * smpl);  // a chain frees the samplers it owns

``Chain`` (layer 2) owns one chain and frees it through an ``ExitStack``. The chain is the one
``Llama._init_sampler`` builds for ``create_completion``: penalties (repeat / frequency / presence
over the last ``penalty_last_n`` accepted tokens), then greedy at temperature 0, else top-k ->
typical -> top-p -> min-p (each with ``min_keep = 1``) -> temperature -> a distribution seeded once.

``sample`` is what ``llama_sampler_sample(chain, ctx, -1)`` does (llama-sampler.cpp): fill a
``llama_token_data`` array ``{id, logit, 0}`` from one logits row, apply the chain, take the
selected token, accept it. Taking the row instead of the context lets a tail that batches several
sessions in one ``llama_decode`` sample each from its own row.

Rebuilding the state (failover). The chain's state is the penalty window and the dist sampler's
``std::mt19937``, which cannot be read out. It is rebuilt exactly instead: a fresh chain with the
same seed, then ``advance(token)`` for every token sampled so far. ``llama_sampler_dist_apply``
draws exactly one uniform number per call on a non-empty candidate array, whatever the logits
(its one-candidate branch draws too, "to keep the RNG state aligned"), and no other sampler of the
chain draws or keeps state besides the penalties' window, which ``accept`` fills. So ``advance``
applies the chain to a one-candidate array (one draw) and accepts the token that was sampled
(tests/test_sampling_parity.py checks the continuation is identical).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

import llama_cpp
import numpy as np
import numpy.typing as npt

from meshnode.errors import ExecutorError

#: ``llama_token_data`` {id: int32, logit: float, p: float}, as a numpy record (same layout)
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
#: ``LLAMA_DEFAULT_SEED``: llama.cpp draws a random seed for it, so a run could not be repeated
RANDOM_SEED = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """What ``Llama._init_sampler`` takes (its defaults are ``Llama.create_completion``'s)."""

    #: 0 = greedy (argmax, first maximum on ties); > 0 samples
    temperature: float = 0.8
    #: keep the k most likely tokens (0 = off)
    top_k: int = 40
    #: nucleus cut-off (1 = off)
    top_p: float = 0.95
    #: drop tokens below min_p x the top probability (0 = off)
    min_p: float = 0.05
    #: locally typical sampling (1 = off)
    typical_p: float = 1.0
    #: divide a seen token's positive logit by this, multiply a negative one (1 = off)
    repeat_penalty: float = 1.0
    #: subtract count x this from a seen token's logit (0 = off)
    frequency_penalty: float = 0.0
    #: subtract this from a seen token's logit (0 = off)
    presence_penalty: float = 0.0
    #: tokens the penalties look back over (``Llama``'s ``last_n_tokens_size``)
    penalty_last_n: int = 64
    #: the dist sampler's seed (0 .. 2**32 - 2)
    seed: int = 0


class Chain:
    """One llama.cpp sampler chain for one generation (not thread-safe: one session uses it)."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        if not 0 <= params.seed < RANDOM_SEED:
            raise ExecutorError(f"seed {params.seed} is outside 0..{RANDOM_SEED - 1}")
        self.params, self.n_vocab = params, n_vocab
        self._stack = contextlib.ExitStack()
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if not chain:
            raise ExecutorError("llama_sampler_chain_init failed")
        self._chain = chain
        self._stack.callback(llama_cpp.llama_sampler_free, chain)
        for make in _samplers(params, n_vocab):
            smpl = make()  # each is owned by the chain as soon as it is added (freed with it)
            if not smpl:
                self.close()
                raise ExecutorError(f"llama.cpp could not create the sampler {make.func.__name__}")
            llama_cpp.llama_sampler_chain_add(chain, smpl)
        #: greedy with the penalties off: llama.cpp's chain is then its greedy sampler alone, the first
        #: maximum (llama_sampler_greedy_apply), which ``np.argmax`` picks without filling a 49k-entry
        #: candidate array (~90 us a token against ~5 on this machine kind)
        self.argmax = params.temperature == 0.0 and not _penalised(params)
        self._cur = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._one = np.zeros(1, dtype=TOKEN_DATA)

    def sample(self, logits: npt.NDArray[np.float32]) -> int:
        """Sample a token from one row of logits and accept it (``llama_sampler_sample``)."""
        if logits.shape != (self.n_vocab,):
            raise ExecutorError(f"logits of shape {logits.shape} for a vocabulary of {self.n_vocab}")
        if self.argmax:
            top = int(np.argmax(logits))
            if not np.isnan(logits[top]):  # a NaN row goes through llama.cpp, which compares past NaNs
                return top  # the chain's state would not move: greedy and no-op penalties keep none
        cur = self._cur
        cur["id"] = self._ids
        cur["logit"] = logits
        cur["p"] = 0.0
        selected = self._apply(cur)
        if not 0 <= selected < self.n_vocab:
            raise ExecutorError(f"the sampler chain selected candidate {selected} of {self.n_vocab}")
        token = int(cur["id"][selected])
        llama_cpp.llama_sampler_accept(self._chain, token)
        return token

    def advance(self, token: int) -> None:
        """Move the state on as a ``sample`` that returned ``token`` would (one draw, accept it)."""
        self._one[0] = (token, 0.0, 0.0)
        self._apply(self._one)
        llama_cpp.llama_sampler_accept(self._chain, token)

    def _apply(self, cur: npt.NDArray[np.void]) -> int:
        arr = llama_cpp.llama_token_data_array(
            data=cur.ctypes.data_as(llama_cpp.llama_token_data_p), size=len(cur), selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(arr))
        return int(arr.selected)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _penalised(p: SamplingParams) -> bool:
    """True if the penalties sampler changes logits (llama.cpp skips it when all three are neutral)."""
    return p.penalty_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                      or p.presence_penalty != 0.0)


def _samplers(p: SamplingParams, n_vocab: int) -> list[functools.partial[llama_cpp.llama_sampler_p]]:
    """The samplers of ``Llama._init_sampler`` (llama-cpp-python 0.3.36, llama.py), in its order."""
    make = functools.partial
    out = [make(llama_cpp.llama_sampler_init_penalties, n_vocab, p.penalty_last_n, p.repeat_penalty,
                p.frequency_penalty, p.presence_penalty)]
    if p.temperature == 0.0:
        return [*out, make(llama_cpp.llama_sampler_init_greedy)]
    min_keep = 1  # Llama: max(1, n_probs) with n_probs = 0
    return [*out, make(llama_cpp.llama_sampler_init_top_k, p.top_k),
            make(llama_cpp.llama_sampler_init_typical, p.typical_p, min_keep),
            make(llama_cpp.llama_sampler_init_top_p, p.top_p, min_keep),
            make(llama_cpp.llama_sampler_init_min_p, p.min_p, min_keep),
            make(llama_cpp.llama_sampler_init_temp, p.temperature),
            make(llama_cpp.llama_sampler_init_dist, p.seed)]
