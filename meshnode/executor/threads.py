"""How many threads a lone session's decode steps take, chosen by what the steps measure.

A lone session's hops take turns, so the hop that computes may have every core (``n_threads_solo``).
On a quiet machine that decodes ~1.5 times as fast as one thread; on a host that steals its vCPUs (a
busy hypervisor, a noisy neighbour) a team of threads waits for a partner the host has taken at each of
a graph's hundreds of barriers, and the same steps ran at a fifth of one thread's speed
(docs/performance.md, "One session on one machine"). So the executor measures: each thread count keeps
a moving average of its steps' time, the faster one is used, and every ``PROBE_EVERY``-th step tries the
other, so a change of the host's weather is noticed within a few dozen tokens.

Pure: no clock, no llama.cpp; the executor records each step's time and asks before the next.
"""

from __future__ import annotations

#: a step out of this many takes the thread count not in favour, to keep its average current
PROBE_EVERY = 32
#: weight of the newest step in a moving average
ALPHA = 0.25


class ThreadChooser:
    """Between ``options`` (thread counts), the one whose steps have been fastest lately."""

    def __init__(self, options: tuple[int, ...]) -> None:
        self.options = tuple(sorted(set(options), reverse=True))
        #: moving average of seconds per step, per thread count (absent until measured)
        self.mean: dict[int, float] = {}
        self.steps = 0

    def pick(self) -> int:
        """The thread count of the next step (no state changes: asking twice gives the same answer)."""
        for n in self.options:
            if n not in self.mean:
                return n  # each count measured once first, the most threads first
        best = self._best()
        if len(self.options) > 1 and self.steps % PROBE_EVERY == PROBE_EVERY - 1:
            return min((n for n in self.options if n != best), key=lambda n: self.mean[n])
        return best

    def _best(self) -> int:
        return min(self.options, key=lambda n: (self.mean[n], -n))

    def record(self, threads: int, seconds: float) -> None:
        """One step of ``threads`` took ``seconds``. A count out of favour is measured only by its
        probes, so its average is as old as the last one: a probe replaces it."""
        if threads not in self.options:
            return
        old = self.mean.get(threads)
        if old is None or len(self.mean) < len(self.options) or threads != self._best():
            self.mean[threads] = seconds
        else:
            self.mean[threads] = old + ALPHA * (seconds - old)
        self.steps += 1
