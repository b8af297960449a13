"""The executor's one config. Every hop of a route must use equal numerics settings."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _cpus() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ExecConfig:
    #: KV cells per session (llama.cpp sequence), ``--ctx-size``: a prompt plus its output must fit.
    #: 0 = the model's training context within the memory budget (executor/context.py), resolved when
    #: the range loads. Not a numerics setting: attention runs over the used cells, padded to 256.
    n_ctx_per_session: int = 0
    #: max tokens per llama_decode call; prefill chunks are cut at this size.
    #: 512 = Llama's default n_batch. Changes numerics: equal on every hop.
    n_batch: int = 512
    #: physical micro-batch. 512 = Llama's default n_ubatch. Changes numerics.
    n_ubatch: int = 512
    #: concurrent sessions (KV sequences) this executor holds
    max_sessions: int = 4
    #: threads for single-token decode (Llama's default: cpu_count // 2)
    n_threads: int = max(_cpus() // 2, 1)
    #: threads for prompt processing (Llama's default: cpu_count)
    n_threads_batch: int = _cpus()
    #: flash attention: off, as Llama's default. Changes greedy tokens: equal on every hop.
    flash_attn: bool = False
    #: run batches of single-token decode steps on the calling asyncio loop's thread instead of handing
    #: them to the llama.cpp worker thread (docs/architecture.md, "executor placement"): two thread
    #: wake-ups less per step and hop. Prompt chunks always go to the worker thread.
    inline_decode: bool = True

    def numerics(self) -> dict[str, int | bool]:
        """The settings that change numerics; hops of one route must agree on them."""
        return {
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
        }
