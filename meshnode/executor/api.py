"""Layer 3: the executor API the node calls.

``RangeExecutor`` runs one loaded range for many sessions. Each session owns
one KV sequence (a slot) from ``open_slot`` until ``release``.

Concurrency: llama.cpp contexts are not thread-safe, so every call into the
context holds one lock (``_ctx``): the equivalent of a ``CapacityLimiter(1)``
per context. Calls run on a dedicated worker thread, never on trio's loop.

Batching: ``forward`` only queues a chunk. Dispatch happens on the node's
asyncio data-plane loop one iteration later (``loop.call_soon``), so the
steps of every session whose frame arrived in the same loop iteration are
queued by then; ``pick_batch`` takes the oldest chunk plus later ones of the
same length for other sessions, within one micro-batch, and they run as a
single llama_decode: one pass over the weights serves all of them. A lone
session pays nothing for this; concurrent sessions' steps coalesce on their
own while the context is busy. While several sessions are live, their decode
steps also wait for each other until a group is whole or a loop iteration or
two bring no more (``settled``): one link message's rows reach the executor
from their sessions' coroutines an iteration or two apart. A hop with hops
after it (the head) cuts its active slots, in order, into as many groups as
there are hops (``group_of``): llama.cpp runs a batch over consecutive KV
sequences only, so a group must be a run of slots; it waits a bounded time
for a group's members still computing further on, so groups that came apart
come back together. The hops after it take the groups as they arrive.

Where a batch runs: a batch of single-token decode steps (a few ms) runs
right there on the data-plane loop's thread when ``ExecConfig.inline_decode``
is on and the context is free; everything else (prompt chunks, releases)
runs on the worker thread. Handing a decode step to a thread and back costs
two thread wake-ups, ~0.1-0.2 ms each on a small VM, on every token of every
hop; running it inline blocks only the data-plane loop (never trio's), for
one step, during which the context could serve nobody else anyway.

The awaitables are asyncio futures because the node's per-session data path
runs as asyncio coroutines (docs/architecture.md, "the bridge"). Cancelling
an await does not interrupt llama.cpp: the step runs to completion and its
result is dropped, so the KV state stays consistent with ``next_pos``.

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
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import trio

from meshnode.errors import CancelledError, CapacityError
from meshnode.executor import openmp
from meshnode.executor._llama import F32, Chunk, LlamaRange, StepOutput, Vocab, batchable
from meshnode.executor.config import ExecConfig
from meshnode.executor.threads import ThreadChooser
from meshnode.gguf.slicer import RangeArtifact, Role

T = TypeVar("T")


@dataclass(frozen=True)
class Timed:
    output: StepOutput
    #: time inside llama.cpp of the batch this chunk ran in
    compute_nanos: int
    #: chunks in that batch (1 = ran alone)
    batch_size: int = 1


def pick_batch(pending: Sequence[tuple[int, int]], n_ubatch: int, most: int = 0,
               among: Collection[int] | None = None) -> list[int]:
    """Indices of the queued chunks ``[(seq, n_tokens)]`` (oldest first) to run as one batch.

    The oldest always runs; later chunks of other sessions join while the
    batch stays ``batchable`` (equal lengths within one micro-batch), so no
    session waits behind a batch it could not join for longer than one step;
    ``most`` (0: no bound) chunks at the most, of sessions ``among`` these
    (None: any).
    """
    if not pending:
        return []
    seq0, n0 = pending[0]
    chosen, seqs, lengths = [0], {seq0}, [n0]
    for i, (seq, n) in enumerate(pending[1:], start=1):
        if most and len(chosen) >= most:
            break
        if seq in seqs or (among is not None and seq not in among) or not batchable([*lengths, n], n_ubatch):
            continue
        chosen.append(i)
        seqs.add(seq)
        lengths.append(n)
    return chosen


def group_of(live: Sequence[int], seq: int, size: int) -> list[int]:
    """The group of ``seq`` when the live slots, in order, are cut into blocks of ``size``.

    llama.cpp runs one batch over consecutive sequences only (a batch of slots 0, 2, 4 and 6 is four
    passes over the weights; docs/protocol.md, "Batches"), so a hop's groups are runs of its slots, and
    a group that is a run at one hop is one at the next (``SessionOpen.slot_hint``).
    """
    order = sorted(live)
    if seq not in order or size < 1:
        return [seq]
    at = order.index(seq) // size * size
    return order[at:at + size]


#: loop iterations in a row that must queue nothing new before several sessions' decode steps dispatch
QUIET_ITERATIONS = 2
#: loop iterations a dispatch waits for a group at the most (a group trickling in never holds it longer)
MOST_WAIT_ITERATIONS = 16
#: the head of a route waits for the rest of its oldest step's group at most this many times its last
#: decode batch's time (the other groups pass through the hops after it meanwhile)
PATIENCE_BATCHES = 2.0
#: ... and never more than this many seconds
MOST_PATIENCE = 1.0
#: seconds between looks while waiting so (not a busy loop: the core may be another hop's meanwhile)
WAIT_STEP = 0.0005


def settled(queued: int, full: int, quiet: int, waited: int, late: float = 0.0, patience: float = 0.0) -> bool:
    """Whether several live sessions' queued decode steps should run now rather than a little later.

    ``queued`` steps of the group wait, ``full`` would make it whole (0: no bound), ``quiet`` loop
    iterations in a row queued nothing new, ``waited`` iterations and ``late`` seconds have passed since
    the first look. The hop before this one computed a group as one batch and its rows arrive in one
    link message, but each session's frame reaches the executor from its own coroutine, one or two
    iterations apart: run on the first, a group of 4 becomes a batch of 1 and one of 3, two passes over
    the weights for one. The head of a route also waits up to ``patience`` seconds for members of its
    group still computing further on: groups whose sessions came apart come back together.
    """
    if full and queued >= full:
        return True
    if late < patience:
        return False
    return quiet >= QUIET_ITERATIONS or waited >= MOST_WAIT_ITERATIONS


def _awaitable(cfut: concurrent.futures.Future[T], loop: asyncio.AbstractEventLoop) -> asyncio.Future[T]:
    """``asyncio.wrap_future`` with a same-thread fast path.

    A decode batch that ran inline resolves its futures on the loop's own thread: the result is
    copied straight into the asyncio future (its waiter wakes in the next loop iteration), not
    through ``call_soon_threadsafe`` (a write to the loop's self-pipe and one more iteration).
    Results from the worker thread still go through ``call_soon_threadsafe``. Cancelling the
    asyncio future cancels ``cfut`` (which only succeeds while the chunk has not started).
    """
    afut: asyncio.Future[T] = loop.create_future()
    loop_thread = threading.get_ident()

    def copy(f: concurrent.futures.Future[T]) -> None:
        if afut.done():
            return
        if f.cancelled():
            afut.cancel()
        elif (e := f.exception()) is not None:
            afut.set_exception(e)
        else:
            afut.set_result(f.result())

    def done(f: concurrent.futures.Future[T]) -> None:
        if threading.get_ident() == loop_thread:
            copy(f)
        elif not loop.is_closed():  # a closed loop has no waiter left to tell
            loop.call_soon_threadsafe(copy, f)

    def cancelled(a: asyncio.Future[T]) -> None:
        if a.cancelled():
            cfut.cancel()

    cfut.add_done_callback(done)
    afut.add_done_callback(cancelled)
    return afut


@dataclass(eq=False)  # compared by identity: the chunk holds arrays
class _Job:
    chunk: Chunk
    future: concurrent.futures.Future[Timed]
    #: groups the sessions should compute in (the hops from here to the tail): decode batches are cut to
    #: live sessions / groups, so this hop computes one group while the hops after it compute the others
    groups: int = 1


class RangeExecutor:
    """One range, loaded; sessions share its context through KV sequences."""

    def __init__(self, artifact: RangeArtifact, config: ExecConfig) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llama",
                                                           initializer=openmp.name_this_thread,
                                                           initargs=(openmp.WORKER_NAME,))
        # load on the worker thread too: llama.cpp state lives on one thread
        self._range: LlamaRange = self._pool.submit(LlamaRange, artifact, config).result()
        self._pool.submit(openmp.release_team).result()
        self.artifact = artifact
        #: the config as the range resolved it (the default --ctx-size decided)
        self.config = self._range.config
        self._free = list(range(config.max_sessions - 1, -1, -1))
        #: a lone session's decode threads, chosen by its steps' times
        self._solo = ThreadChooser((self.config.n_threads, self.config.n_threads_solo))
        self.steps_total = 0
        self.batches_total = 0
        #: guards the queue and ``_draining``
        self._lock = threading.Lock()
        #: held by whoever is inside llama.cpp (the worker thread or an inline batch)
        self._ctx = threading.Lock()
        self._queue: list[_Job] = []
        #: a dispatch is scheduled or a drainer runs: forward() only queues
        self._draining = False
        #: while several sessions' decode steps gather for one batch (``settled``): the group's steps queued
        #: at the last look, the iterations in a row that stayed so, the iterations waited, when it began
        self._gather: tuple[int, int, int, float] | None = None
        #: ``batches_total`` when each slot's last decode step ran: a slot that ran lately is active
        self._ran: dict[int, int] = {}
        #: seconds the last batch of decode steps took
        self._batch_seconds = 0.0
        #: a decode step on several threads may run on the data plane's thread: there is no OpenMP team (a
        #: ggml pool of the context's own, or threads per graph), the worker gives its OpenMP team back
        #: whenever it goes idle, or libgomp keeps its spin with a team there and another on the worker
        #: (openmp.py; the environment libgomp read when it loaded)
        self._inline_teams = (self._range.threads_rest or openmp.can_release_teams()
                              or openmp.teams_keep_their_spin())

    def run_blocking(self, fn: Callable[[LlamaRange], T]) -> T:
        """Run ``fn(range)`` on the executor's thread and wait (start-up work only)."""
        try:
            return self._pool.submit(self._locked, fn, self._range).result()
        finally:
            self._pool.submit(openmp.release_team).result()

    def _locked(self, fn: Callable[..., T], *args: object) -> T:
        with self._ctx:
            return fn(*args)

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

    @property
    def decode_threads(self) -> int:
        """Threads for the next batch of decode steps: while one session is live (its hops take turns),
        ``n_threads_solo`` or ``n_threads``, whichever its steps have measured faster lately
        (executor/threads.py); while several are (their hops compute at once), ``n_threads``."""
        return self._solo.pick() if self.live_slots <= 1 else self.config.n_threads

    # -- sessions --------------------------------------------------------------

    def open_slot(self, prefer: int | None = None) -> int:
        """A free slot: ``prefer`` if it is free (the slot the hop before gave the session), else the
        lowest free one (llama.cpp batches runs of consecutive sequence ids: ``group_of``)."""
        with self._lock:
            if not self._free:
                raise CapacityError(f"all {self.config.max_sessions} session slots are in use")
            if prefer is not None and prefer in self._free:
                self._free.remove(prefer)
                return prefer
            self._free.sort(reverse=True)
            return self._free.pop()

    def _live(self) -> list[int]:
        """Under ``_lock``: the slots in use, in order."""
        free = set(self._free)
        return [s for s in range(self.config.max_sessions) if s not in free]

    def _group(self) -> tuple[list[int] | None, int]:
        """Under ``_lock``, with decode steps queued: the sessions the oldest step's batch may take (None:
        any) and how many steps make it whole. The head of a route of several hops: the
        oldest's group of the active slots (``group_of``; active: queued, or run in the last 2 x groups
        batches, so a session that idles between requests is nobody's to wait for); any other hop: every
        live one."""
        groups = max((j.groups for j in self._queue), default=1)
        if groups <= 1 or not self._range.takes_tokens:
            # the head forms the groups; a hop after it takes what arrives, the head's groups as they come
            # (slot hints keep them runs here too), where its own cut could split one
            return None, self.live_slots
        queued = {j.chunk.seq for j in self._queue}
        recent = self.batches_total - 2 * groups
        active = [s for s in self._live() if s in queued or self._ran.get(s, recent - 1) >= recent]
        block = group_of(active, self._queue[0].chunk.seq, -(-len(active) // groups))
        return block, len(block)

    async def release(self, slot: int) -> None:
        """Free the slot's KV and hand the slot back; completes even if the caller is cancelled.

        Callers release while cleaning up, which is exactly when grpc cancels a
        handler (its client cancels the call once it has the final reply), so
        the slot goes back to the free list on the worker, not after this await.
        Chunks of the slot still queued are refused (they belong to the session
        being released; run later, they would write into a freed or reused slot).
        """
        with self._lock:
            self._ran.pop(slot, None)
            stale = [j for j in self._queue if j.chunk.seq == slot]
            self._queue = [j for j in self._queue if j.chunk.seq != slot]
        for job in stale:
            if job.future.set_running_or_notify_cancel():  # False: its waiter is gone already
                job.future.set_exception(CancelledError(f"the session of slot {slot} was released"))
        # shielded: wrap_future would cancel the queued release along with this wait
        await asyncio.shield(asyncio.wrap_future(self._pool.submit(self._release, slot)))

    def _release(self, slot: int) -> None:
        """On the worker, after every batch that was already running."""
        try:
            with self._ctx:
                self._range.release(slot)
        finally:
            with self._lock:
                self._free.append(slot)

    async def truncate(self, slot: int, n_past: int) -> None:
        await asyncio.wrap_future(self._pool.submit(self._locked, self._range.truncate, slot, n_past))

    def next_pos(self, slot: int) -> int:
        return self._range.next_pos(slot)

    async def forward(self, slot: int, pos0: int, *, tokens: npt.NDArray[np.int32] | None = None,
                      embd: F32 | None = None, groups: int = 1) -> Timed:
        """Queue one chunk of one session; resolves when its batch has run. ``groups``: see ``_Job``."""
        job = _Job(Chunk(slot, pos0, tokens, embd), concurrent.futures.Future(), max(groups, 1))
        loop = asyncio.get_running_loop()
        with self._lock:
            self._queue.append(job)
            if not self._draining:
                self._draining = True
                loop.call_soon(self._dispatch)
        try:
            return await _awaitable(job.future, loop)
        except asyncio.CancelledError:
            with self._lock:  # not started yet: never run it (a resume may truncate this slot next)
                if job in self._queue:
                    self._queue.remove(job)
            raise

    def _take(self) -> list[_Job]:
        """Under ``_lock``: the next batch, taken off the queue and marked running."""
        # a chunk whose waiter was cancelled before it started never runs (its future
        # is cancelled and could take no result)
        self._queue = [j for j in self._queue if not j.future.cancelled()]
        if not self._queue:
            return []
        decode = self._decoding(self._queue)
        among, size = self._group() if decode else (None, 0)
        most = 0 if among is None else size
        if not self._range.batches_exactly:
            among, most = None, 1  # a MoE range: one session per llama_decode (LlamaRange.batches_exactly)
        idx = pick_batch([(j.chunk.seq, self._rows(j.chunk)) for j in self._queue], self.config.n_ubatch, most,
                         None if among is None else set(among))
        picked = [self._queue[i] for i in idx]
        for i in sorted(idx, reverse=True):
            del self._queue[i]
        # running from here: a waiter cancelled now no longer cancels the future, the
        # chunk runs to completion and its result is dropped (docstring above)
        return [j for j in picked if j.future.set_running_or_notify_cancel()]

    def _dispatch(self) -> None:
        """On the data-plane loop, one iteration after a chunk was queued into an idle executor.

        A batch of decode steps runs here if the context is free; anything else, and anything
        left after it, is handed to the worker thread, which drains the queue.
        """
        wait = self._gathered()
        if wait is not None:
            loop = asyncio.get_running_loop()
            if wait:
                loop.call_later(wait, self._dispatch)
            else:
                loop.call_soon(self._dispatch)
            return
        # never on a trio thread (a trio-asyncio loop runs there): trio's loop is never blocked.
        # A llama_decode on several threads starts an OpenMP team on the calling thread; two threads that
        # each own a team (this one and the worker) make libgomp count more threads than cores and cut its
        # spin, to 100 rounds without a wait policy (openmp.py): then every barrier of every graph sleeps
        # and wakes (measured: 140 context switches per token, decode at a third of its speed). Where the
        # worker cannot give its team back when idle and no policy is set, such a step stays on the worker
        inline = (self.config.inline_decode and (self.decode_threads == 1 or self._inline_teams)
                  and not trio.lowlevel.in_trio_run() and self._decoding(self._queue))
        if inline and self._ctx.acquire(blocking=False):
            try:
                self._run_one(inline=True)
            finally:
                self._ctx.release()
            if self._more():
                asyncio.get_running_loop().call_soon(self._dispatch)  # more arrived meanwhile: same rules
            return
        self._pool.submit(self._drain)

    def _gathered(self) -> float | None:
        """None if the queue may dispatch now: always, unless several sessions' decode steps are still
        gathering into one batch (``settled``); then the seconds until the next look (0: the next loop
        iteration)."""
        with self._lock:
            if (self.live_slots <= 1 or not self._range.batches_exactly or not self._queue
                    or not self._decoding(self._queue)):
                self._gather = None
                return None
            among, full = self._group()
            queued = len(self._queue) if among is None else sum(j.chunk.seq in among for j in self._queue)
            now = time.monotonic()
            seen, quiet, waited, since = self._gather or (0, 0, 0, now)
            quiet = quiet + 1 if queued <= seen else 0
            patience = PATIENCE_BATCHES * self._batch_seconds if among is not None else 0.0  # the head
            if settled(queued, full, quiet, waited, now - since, min(patience, MOST_PATIENCE)):
                self._gather = None
                return None
            self._gather = (queued, quiet, waited + 1, since)
            return WAIT_STEP if quiet >= QUIET_ITERATIONS else 0.0

    def _drain(self) -> None:
        """On the worker: run one batch of what is queued, then come back for the rest."""
        try:
            with self._ctx:
                self._run_one()
        finally:  # whatever happened, the queue keeps draining
            if self._more():
                self._pool.submit(self._drain)
            else:
                openmp.release_team()  # idle: the data plane's team is the process's only one (openmp.py)

    def _run_one(self, *, inline: bool = False) -> None:
        """Take the next batch and run it (the caller holds ``_ctx``)."""
        with self._lock:
            jobs = self._take()
        if jobs:
            self._run(jobs, inline=inline)

    def _more(self) -> bool:
        """Whether chunks are left to run; if not, the executor goes idle (``_draining`` off)."""
        with self._lock:
            if self._queue:
                return True
            self._draining = False
            return False

    def _run(self, jobs: list[_Job], *, inline: bool = False) -> None:
        try:
            # an inline batch stays on one thread unless several may run there (a session may have ended
            # between the dispatch's choice and this batch)
            one = inline and not self._inline_teams
            self._range.decode_threads = 1 if one else self.decode_threads
            t0 = time.perf_counter_ns()
            outs = self._range.forward_many([j.chunk for j in jobs])
            took = time.perf_counter_ns() - t0
            if len(jobs) == 1 and self._rows(jobs[0].chunk) == 1 and self.live_slots <= 1:
                self._solo.record(self._range.decode_threads, took / 1e9)  # a lone session's step
        except Exception as e:  # handed to every waiter
            outs, took = [e] * len(jobs), 0
        self.steps_total += len(jobs)
        self.batches_total += 1
        if self._decoding(jobs):
            self._batch_seconds = took / 1e9
            for j in jobs:
                self._ran[j.chunk.seq] = self.batches_total
        for job, out in zip(jobs, outs, strict=True):
            if isinstance(out, Exception):
                job.future.set_exception(out)
            else:
                job.future.set_result(Timed(out, took, len(jobs)))

    @classmethod
    def _decoding(cls, jobs: Sequence[_Job]) -> bool:
        """Whether every chunk is one decode step (a row)."""
        return all(cls._rows(j.chunk) == 1 for j in jobs)

    @staticmethod
    def _rows(c: Chunk) -> int:
        if c.tokens is not None:
            return len(c.tokens)
        return 0 if c.embd is None else int(c.embd.shape[0])

    def close(self) -> None:
        self._pool.submit(self._locked, self._range.close).result()
        self._pool.shutdown(wait=True)
