"""Drafting with a small model run whole at the initiator (``--model-draft PATH``).

The draft model keeps one KV sequence across rounds: each round it drops what the route rejected
(the longest common prefix of what it has seen and the text so far stands), feeds the text's new
tokens, and decodes up to k tokens greedily. Its vocabulary must be the route's: the same text
must tokenize to the same ids (``check_vocab``), else its drafts would mean other words (refused).
Blocking: the initiator calls it on a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshnode import errors

#: what both tokenizers must agree on: words, digits, punctuation, code, and characters of several scripts
PROBE = ("The quick brown fox jumps over the lazy dog. 1234567890 +-*/=<>()[]{} def f(x): return x**2\n"
         "naïve café — Ünïcödé 日本語 русский ελληνικά 🙂")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ModelDrafter:
    """A small GGUF, whole, in this process: greedy drafts of the text's continuation."""

    def __init__(self, path: Path, n_ctx: int) -> None:
        from meshnode.executor._llama import LlamaRange
        from meshnode.executor.config import ExecConfig
        from meshnode.gguf.slicer import whole_model

        threads = max(len(os.sched_getaffinity(0)) // 2, 1)
        self.range = LlamaRange(whole_model(path), ExecConfig(n_ctx_per_session=max(n_ctx, 256), max_sessions=1,
                                                              n_threads=threads, n_threads_solo=threads))
        assert self.range.vocab is not None
        self.vocab = self.range.vocab
        #: the tokens whose positions its KV holds, in order
        self.fed: list[int] = []

    def check_vocab(self, route_ids: Sequence[int]) -> None:
        """InputError unless the route's tail tokenized ``PROBE`` to these same ids."""
        mine = self.vocab.tokenize(PROBE)
        if list(route_ids) != mine:
            raise errors.InputError("--model-draft has another vocabulary than the route's model (the same text "
                                    "tokenizes to other ids): its drafts would be other words")

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy tokens after ``history`` (the prompt and the text so far)."""
        if k <= 0 or not history:
            return []
        keep = common_prefix(self.fed, history)
        if keep == len(history):  # it holds all of it already: re-feed the last token for its logits
            keep -= 1
        if keep < len(self.fed):
            self.range.truncate(0, keep)
            del self.fed[keep:]
        room = self.range.n_ctx_seq - len(history)
        k = min(k, room)
        if k <= 0:
            return []
        new = list(history[keep:])
        step = self.range.config.n_batch
        out = None
        for i in range(0, len(new), step):
            chunk = np.asarray(new[i : i + step], dtype=np.int32)
            out = self.range.forward(0, len(self.fed), tokens=chunk)
            self.fed.extend(int(t) for t in chunk)
        assert out is not None
        assert out.logits is not None
        drafts = [int(np.argmax(out.logits))]
        while len(drafts) < k and not self.vocab.is_eog(drafts[-1]):
            out = self.range.forward(0, len(self.fed), tokens=np.asarray(drafts[-1:], dtype=np.int32))
            self.fed.append(drafts[-1])
            assert out.logits is not None
            drafts.append(int(np.argmax(out.logits)))
        return drafts

    def close(self) -> None:
        self.range.close()
