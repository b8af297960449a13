"""Whether a route's hops can compute at the same time: do any two share CPU cores?

Pipelining a prefill (hop *i + 1* on chunk *k* while hop *i* is on chunk
*k + 1*) pays when each hop has cores of its own: on two one-core "machines"
(nodes pinned with ``taskset``) a 2,055-token prefill took 0.65 x the whole
model's time. When hops share cores, two llama.cpp thread teams of n threads
each run on the same n cores, and every barrier waits for a preempted thread:
on one 2-vCPU machine the same prefill took 1.27 x the whole model's time
pipelined and 1.04 x one chunk at a time (docs/performance.md, "Prefill").

Pure: takes each hop's advertised ``(host_id, cpus)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence


def share_cores(hops: Sequence[tuple[str, Collection[int]]]) -> bool:
    """True if two hops run on one machine (same non-empty ``host_id``) with a CPU in common.

    A hop that does not say which machine or CPUs it has shares nothing known: the route's hops are
    taken to be machines of their own, which is what a mesh is for.
    """
    for (host_a, cpus_a), (host_b, cpus_b) in itertools.combinations(hops, 2):
        if host_a and host_a == host_b and set(cpus_a) & set(cpus_b):
            return True
    return False
