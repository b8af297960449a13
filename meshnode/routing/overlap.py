"""Whether a route's hops can compute at the same time without slowing each other down.

A prefill pipelined by chunk (hop *i + 1* on chunk *k* while hop *i* is on
chunk *k + 1*) runs hops at once. It pays when each hop has cores of its
own: on two one-core "machines" (nodes pinned with ``taskset``) a
2,055-token prefill took 0.65 x the whole model's time. When hops on one
machine together run more llama.cpp threads than it has cores, every
barrier waits for a preempted thread: on one 2-vCPU machine, hops
prefilling on 2 threads each took 1.27 x the whole model's time pipelined
and 1.04 x one chunk at a time (docs/performance.md, "Prefill").

Pure: takes each hop's advertised ``(host_id, cpus, threads)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence


def overcommitted(hops: Sequence[tuple[str, Collection[int], int]]) -> bool:
    """True if the hops on some one machine (same non-empty ``host_id``) whose CPUs overlap would run
    more threads at once than those CPUs number.

    A hop that does not say which machine it is on, or how many threads it runs, counts as a machine
    of its own: that is what a mesh is for.
    """
    by_host: dict[str, list[tuple[set[int], int]]] = defaultdict(list)
    for host, cpus, threads in hops:
        if host and threads:
            by_host[host].append((set(cpus), threads))
    for on_host in by_host.values():
        # hops whose CPU sets overlap (transitively) compete for the union of them
        groups: list[tuple[set[int], int, int]] = []  # (cpus, threads, hops)
        for cpus, threads in on_host:
            merged = (set(cpus), threads, 1)
            rest = []
            for g in groups:
                if g[0] & merged[0]:
                    merged = (g[0] | merged[0], g[1] + merged[1], g[2] + merged[2])
                else:
                    rest.append(g)
            groups = [*rest, merged]
        if any(hops > 1 and threads > len(cpus) for cpus, threads, hops in groups):
            return True
    return False
