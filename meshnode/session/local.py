"""The whole model in one process: ``meshnode generate --model PATH`` (no peers).

Samples with the same llama.cpp chain (``executor.sampler.Chain``) and cuts the text with the
same ``Completion`` as a route's tail and initiator, so a seed gives the same text here as
across any route.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from meshnode import errors
from meshnode.executor._llama import LlamaRange, StepOutput, Vocab
from meshnode.executor.config import ExecConfig
from meshnode.executor.context import check_fits
from meshnode.executor.sampler import Chain
from meshnode.gguf.slicer import whole_model
from meshnode.session.completion import Completion
from meshnode.session.initiator import (
    GenerateConfig,
    GenerationResult,
    OnToken,
    check_generate,
    new_completion,
    seed_of,
)


def generate_local(model: Path, cfg: GenerateConfig, exec_cfg: ExecConfig,
                   on_token: OnToken | None = None) -> GenerationResult:
    check_generate(cfg)
    # the source file as it is: no cut, no hashing (nothing is attested here), metadata only read
    rng_range = LlamaRange(whole_model(model), ExecConfig(**{**exec_cfg.__dict__, "max_sessions": 1}))
    try:
        vocab = rng_range.vocab
        assert vocab is not None
        prompt, cfg = _prompt(vocab, cfg)
        if cfg.max_tokens == 0:
            cfg = dataclasses.replace(cfg, max_tokens=max(rng_range.n_ctx_seq - len(prompt), 1))
        check_fits(len(prompt), cfg.max_tokens, rng_range.n_ctx_seq)
        t0 = time.perf_counter()
        out = None
        for i in range(0, len(prompt), exec_cfg.n_batch):
            out = rng_range.forward(0, i, tokens=np.asarray(prompt[i : i + exec_cfg.n_batch], dtype=np.int32))
        assert out is not None
        prefill = time.perf_counter() - t0
        completion = new_completion(cfg, vocab.bos, rng_range.n_ctx_seq - len(prompt))
        t1 = time.perf_counter()
        with Chain(cfg.sampling, vocab.n_tokens) as chain:
            _decode(rng_range, vocab, chain, completion, out, len(prompt), on_token)
        if on_token is not None and (rest := completion.release()):
            on_token(None, rest)
        assert completion.finish is not None
        return GenerationResult(
            tokens=list(completion.tokens), text=completion.text, prompt_tokens=prompt,
            stop_reason=completion.finish, prefill_seconds=prefill, decode_seconds=time.perf_counter() - t1,
            route=["local"], seed=seed_of(cfg),
        )
    finally:
        rng_range.close()


def _prompt(vocab: Vocab, cfg: GenerateConfig) -> tuple[list[int], GenerateConfig]:
    """As the route's tail tokenizes (servicer.Tokenize): raw text, or chat through the model's template."""
    if cfg.messages:
        chat = vocab.chat_format().render([{"role": r, "content": c} for r, c in cfg.messages])
        prompt = vocab.tokenize(chat.text, add_special=chat.add_bos, parse_special=True)
        cfg = dataclasses.replace(cfg, stop=cfg.stop + tuple(s for s in chat.stop if s and s not in cfg.stop))
    else:
        prompt = vocab.tokenize(cfg.prompt)
    if not prompt:
        raise errors.InputError("the prompt tokenizes to nothing")
    return prompt, cfg


def _decode(rng_range: LlamaRange, vocab: Vocab, chain: Chain, completion: Completion, out: StepOutput,
            n_prompt: int, on_token: OnToken | None) -> None:
    """Sample, cut, feed back: until the completion is over."""
    pos = n_prompt
    while True:
        assert out.logits is not None
        tok = chain.sample(out.logits)
        eog = vocab.is_eog(tok)
        done = completion.add(tok, vocab.piece(tok), eog=eog)
        if on_token is not None and not eog:
            on_token(tok, completion.release())
        if done:
            return
        out = rng_range.forward(0, pos, tokens=np.asarray([tok], dtype=np.int32))
        pos += 1
