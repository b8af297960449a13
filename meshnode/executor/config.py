"""The executor's one config. Every hop of a route must use equal numerics settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from meshnode.executor.cpus import usable_cpus
from meshnode.executor.linger import cap_from_env


def _cpus() -> int:
    """The logical CPUs this process may run on: a cpuset or ``taskset`` narrows them, and so does a
    cgroup CPU quota (executor/cpus.py)."""
    return usable_cpus()


def _cores() -> int:
    """The physical cores among them: SMT siblings share one core's arithmetic units, so decode, which
    is bound by them and by memory, gains nothing from a second thread per core (llama.cpp's own default
    counts physical cores too). No more than a CPU quota allows."""
    seen = set()
    for cpu in os.sched_getaffinity(0):
        try:
            topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            seen.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            seen.add((str(cpu), ""))
    return min(len(seen) or 1, _cpus())


def _poll() -> int:
    """``MESHNODE_POLL`` (0..100), checked: a typo is the caller's input error, not a crash."""
    from meshnode.errors import InputError

    raw = os.environ.get("MESHNODE_POLL", "0")
    if not raw.strip().isdigit() or int(raw) > 100:
        raise InputError(f"MESHNODE_POLL must be a whole number from 0 to 100 (ggml's polling level), not {raw!r}")
    return int(raw)


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
    #: threads for single-token decode: half the physical cores this process may use (Llama's default is
    #: cpu_count // 2). All of them can decode faster when the node has the cores to itself, but when other
    #: busy processes share them, an OpenMP team of every core sleeps and wakes at its barriers and decode
    #: collapses (4-10 tok/s measured on 2 vCPUs): docs/performance.md, "Threads". ``--threads`` sets it.
    n_threads: int = max(_cores() // 2, 1)
    #: threads for a decode step when it is the only session live on this range. One session's hops take
    #: turns (each waits for the one before it), so the hop that computes can have every physical core (as
    #: llama.cpp's own default): on 2 vCPUs the whole model decodes at ~104 tok/s on 2 threads against ~62
    #: on one (docs/performance.md, "One session on one machine"). Used while its steps measure faster than
    #: ``n_threads`` (executor/threads.py). ``--threads`` sets it too.
    n_threads_solo: int = _cores()
    #: threads for prompt processing (Llama's default: cpu_count; here the CPUs this process may use)
    n_threads_batch: int = _cpus()
    #: flash attention: off, as Llama's default. Changes greedy tokens: equal on every hop.
    flash_attn: bool = False
    #: a LongRoPE model's original context (0: none), read from the file by ``context.resolve_ctx``:
    #: above it llama.cpp takes the long rope factors, so it is part of the numerics hops compare
    rope_ctx_orig: int = 0
    #: run batches of single-token decode steps on the calling asyncio loop's thread instead of handing
    #: them to the llama.cpp worker thread (docs/architecture.md, "executor placement"): two thread
    #: wake-ups less per step and hop. Prompt chunks always go to the worker thread. Only with
    #: ``n_threads == 1``: a decode on more threads would make the loop's thread a second OpenMP master,
    #: and libgomp, counting more threads than cores, then sleeps at every barrier (docs/performance.md).
    inline_decode: bool = True
    #: map the range's file (llama.cpp's default) instead of reading its weights into the process's own
    #: memory; None: read them while they take at most half the memory available, else map
    #: (executor/weights.py, which says why). Not a numerics setting.
    use_mmap: bool | None = None
    #: how long an idle thread of the context's ggml pool (a llama.cpp without OpenMP) polls for the next
    #: graph before it sleeps, 0..100 (ggml's scale; 0 sleeps at once). Not a numerics setting.
    poll: int = field(default_factory=_poll)
    #: the most seconds a range keeps its CPU awake after a step, waiting for the next one (executor/
    #: linger.py; ``MESHNODE_LINGER``, 0: never). Not a numerics setting.
    linger: float = field(default_factory=cap_from_env)

    def numerics(self) -> dict[str, int | bool]:
        """The settings that change numerics; hops of one route must agree on them."""
        return {
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn,
        }
