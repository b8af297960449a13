"""The whole model in one process: ``meshnode generate --model PATH`` (no peers)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from meshnode import errors
from meshnode.executor._llama import LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.executor.context import check_fits
from meshnode.gguf.slicer import whole_model
from meshnode.session.initiator import GenerateConfig, GenerationResult
from meshnode.session.sampling import sample


def generate_local(model: Path, cfg: GenerateConfig, exec_cfg: ExecConfig) -> GenerationResult:
    # the source file as it is: no cut, no hashing (nothing is attested here), metadata only read
    rng_range = LlamaRange(whole_model(model), ExecConfig(**{**exec_cfg.__dict__, "max_sessions": 1}))
    try:
        vocab = rng_range.vocab
        assert vocab is not None
        prompt = vocab.tokenize(cfg.prompt)
        if not prompt:
            raise errors.InputError("the prompt tokenizes to nothing")
        check_fits(len(prompt), cfg.max_tokens, rng_range.n_ctx_seq)
        rng = np.random.default_rng(cfg.seed)
        t0 = time.perf_counter()
        out = None
        for i in range(0, len(prompt), exec_cfg.n_batch):
            out = rng_range.forward(0, i, tokens=np.asarray(prompt[i : i + exec_cfg.n_batch], dtype=np.int32))
        prefill = time.perf_counter() - t0
        tokens: list[int] = []
        pieces: list[bytes] = []
        stop = "length"
        t1 = time.perf_counter()
        while True:
            assert out is not None
            assert out.logits is not None
            tok = sample(out.logits, temperature=cfg.temperature, top_k=0, top_p=1.0, rng=rng)
            tokens.append(tok)
            if vocab.is_eog(tok):
                stop = "eog"
                break
            pieces.append(vocab.piece(tok))
            if len(tokens) >= cfg.max_tokens:
                break
            out = rng_range.forward(0, len(prompt) + len(tokens) - 1, tokens=np.asarray([tok], dtype=np.int32))
        return GenerationResult(
            tokens=tokens, text=b"".join(pieces).decode("utf-8", errors="replace"), prompt_tokens=prompt,
            stop_reason=stop, prefill_seconds=prefill, decode_seconds=time.perf_counter() - t1, route=["local"],
        )
    finally:
        rng_range.close()
