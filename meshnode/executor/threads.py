"""How many threads a lone session's decode steps take, chosen by what the steps measure.

A lone session's hops take turns, so the hop that computes may have every core (``n_threads_solo``).
On a quiet machine that decodes ~1.5 times as fast as one thread; on a host that steals its vCPUs (a
busy hypervisor, a noisy neighbour) a team of threads waits for a partner the host has taken at each of
a graph's hundreds of barriers, and the same steps ran at a fifth of one thread's speed
(docs/performance.md, "One session on one machine"). So the executor measures: each thread count keeps
a moving average of its steps' time, the faster one is used, and now and then a step tries the other
(a *probe*), so a change of the host's weather is noticed within a few dozen tokens.

A probe is a step on the count that measured slower: at one in 32 steps it cost a lone session ~2.5% of
its decode at 1.34 GB (a 2-thread step there takes ~0.55 of a 1-thread one). So while the most threads
stay the favourite, each probe they win doubles the interval, up to ``PROBE_RARELY``; the favourite's
average rising ``SLOWER`` times above what it was at the last probe (the host began to steal) brings the
next probe within ``PROBE_EVERY`` steps. While fewer threads are the favourite (a stealing host), the
interval stays ``PROBE_EVERY``: a host that stops stealing does not slow the favourite, so only a probe
notices it. Fewer threads take over only when they measure ``MARGIN`` faster: on a noisy host a probe
that lands in a lull otherwise moved a lone session onto one thread for a probe period (1.34 GB, one
machine, `bench.ladder`: with a probe every 32nd step the route's hops spent 78.7 ms a token in llama.cpp
against 73.5 with two threads fixed; with this chooser the route ran 0.908 of the whole model against
0.859 with the one before, in turn: docs/performance.md, "A ladder from a pipe to the route").

Pure: no clock, no llama.cpp; the executor records each step's time and asks before the next.
"""

from __future__ import annotations

#: a step out of this many, at most, takes the thread count not in favour, to keep its average current
PROBE_EVERY = 32
#: ... and at least one out of this many: each probe the favourite wins doubles the interval up to here
PROBE_RARELY = 512
#: the favourite's average this much above what it was at the last probe: the weather changed, probe soon
SLOWER = 1.25
#: fewer threads than the most take over only when their steps measure this much faster: a probe that
#: lands in a lull of the host's noise does not move a lone session onto one thread for a probe period
MARGIN = 0.10
#: weight of the newest step in a moving average
ALPHA = 0.25


class ThreadChooser:
    """Between ``options`` (thread counts), the one whose steps have been fastest lately."""

    def __init__(self, options: tuple[int, ...]) -> None:
        self.options = tuple(sorted(set(options), reverse=True))
        #: moving average of seconds per step, per thread count (absent until measured)
        self.mean: dict[int, float] = {}
        #: steps between probes: PROBE_EVERY, doubled by each probe the favourite wins, up to PROBE_RARELY
        #: (a probe is a step on the slower count: at 32 it cost ~2.5% of a lone session's decode)
        self.interval = PROBE_EVERY
        #: steps since the last probe, and the favourite's average then
        self.since = 0
        self.best_then = 0.0

    def pick(self) -> int:
        """The thread count of the next step (no state changes: asking twice gives the same answer)."""
        for n in self.options:
            if n not in self.mean:
                return n  # each count measured once first, the most threads first
        best = self._best()
        if len(self.options) > 1 and self._probe_due(best):
            return min((n for n in self.options if n != best), key=lambda n: self.mean[n])
        return best

    def _probe_due(self, best: int) -> bool:
        if self.since >= self.interval - 1:
            return True
        # the favourite slowed down since the last probe: the other may be faster now
        return self.since >= PROBE_EVERY - 1 and self.mean[best] > SLOWER * self.best_then

    def _best(self) -> int:
        most = self.options[0]
        return min(self.options, key=lambda n: (self.mean[n] * (1 if n == most else 1 + MARGIN), -n))

    def record(self, threads: int, seconds: float) -> None:
        """One step of ``threads`` took ``seconds``. A count out of favour is measured only by its
        probes, so its average is as old as the last one: a probe replaces it."""
        if threads not in self.options:
            return
        old = self.mean.get(threads)
        if old is None or len(self.mean) < len(self.options):
            self.mean[threads] = seconds
            if len(self.mean) == len(self.options):
                self.best_then = self.mean[self._best()]
            return
        best = self._best()
        if threads == best:
            self.mean[threads] = old + ALPHA * (seconds - old)
            self.since += 1
            return
        self.mean[threads] = seconds  # a probe
        now = self._best()
        self.interval = min(self.interval * 2, PROBE_RARELY) if now == best == self.options[0] else PROBE_EVERY
        self.since = 0
        self.best_then = self.mean[now]
