"""Layer 3: the executor API the node calls.

``RangeExecutor`` runs one loaded range for many sessions. Each session owns
one KV sequence (a slot) from ``open_slot`` until ``release``.

Concurrency: llama.cpp contexts are not thread-safe, so every call into the
context runs on one dedicated worker thread (a single-thread pool: the
equivalent of a ``CapacityLimiter(1)`` per context), never on the event loop.
The awaitables are asyncio futures because the node's per-session data path
runs as asyncio coroutines inside trio-asyncio (docs/architecture.md, "the
bridge"). Cancelling an await does not interrupt llama.cpp: the step runs to
completion on the worker and its result is dropped, so the KV state stays
consistent with ``next_pos``.

In-process or a supervised child? In-process (docs/architecture.md,
"executor placement"): a residual crosses no extra IPC boundary on the hot
path, and every input is validated before it reaches llama.cpp (shapes,
token ids, positions, finite values), which is how llama.cpp's asserts are
kept from firing. The node is one process per range under systemd
(Restart=on-failure), so a crash loses only that node's sessions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from meshnode.errors import CapacityError
from meshnode.executor._llama import F32, LlamaRange, StepOutput, Vocab
from meshnode.executor.config import ExecConfig
from meshnode.gguf.slicer import RangeArtifact, Role

T = TypeVar("T")


@dataclass(frozen=True)
class Timed:
    output: StepOutput
    compute_nanos: int


class RangeExecutor:
    """One range, loaded; sessions share its context through KV sequences."""

    def __init__(self, artifact: RangeArtifact, config: ExecConfig) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llama")
        # load on the worker thread too: llama.cpp state lives on one thread
        self._range: LlamaRange = self._pool.submit(LlamaRange, artifact, config).result()
        self.artifact = artifact
        self.config = config
        self._free = list(range(config.max_sessions - 1, -1, -1))
        self.steps_total = 0

    def run_blocking(self, fn: Callable[[LlamaRange], T]) -> T:
        """Run ``fn(range)`` on the executor's thread and wait (start-up work only)."""
        return self._pool.submit(fn, self._range).result()

    # -- properties of the range -------------------------------------------------

    @property
    def role(self) -> Role:
        return self._range.role

    @property
    def n_embd(self) -> int:
        return self._range.n_embd

    @property
    def vocab(self) -> Vocab | None:
        return self._range.vocab

    @property
    def takes_tokens(self) -> bool:
        return self._range.takes_tokens

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def live_slots(self) -> int:
        return self.config.max_sessions - len(self._free)

    # -- sessions --------------------------------------------------------------

    def open_slot(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.config.max_sessions} session slots are in use")
        return self._free.pop()

    async def release(self, slot: int) -> None:
        await asyncio.wrap_future(self._pool.submit(self._range.release, slot))
        self._free.append(slot)

    def next_pos(self, slot: int) -> int:
        return self._range.next_pos(slot)

    async def forward(self, slot: int, pos0: int, *, tokens: npt.NDArray[np.int32] | None = None,
                      embd: F32 | None = None) -> Timed:
        fut = self._pool.submit(self._timed, slot, pos0, tokens, embd)
        return await asyncio.wrap_future(fut)

    def _timed(self, slot: int, pos0: int, tokens: npt.NDArray[np.int32] | None, embd: F32 | None) -> Timed:
        t0 = time.perf_counter_ns()
        out = self._range.forward(slot, pos0, tokens=tokens, embd=embd)
        self.steps_total += 1
        return Timed(out, time.perf_counter_ns() - t0)

    def close(self) -> None:
        self._pool.submit(self._range.close).result()
        self._pool.shutdown(wait=True)
