"""How many layers a joining node takes, and which: as many as its memory holds and its speed merits,
where the mesh is thinnest (pure).

A range's memory is its weights (its blocks, plus the token table for a head and the lm_head for a
tail), its KV cache and compute buffers, and the process itself. The budget (``--memory``, default
``DEFAULT_SHARE`` of what the machine or its cgroup has available) is split: ``KV_SHARE`` of it is
kept for the KV cache and llama.cpp's buffers (a node sizes its context to fit a quarter of the
available memory: executor/context.py), ``BASE`` for the process, the rest for weights. Among the
windows whose weights fit, the longest is taken, placed where the mesh covers least
(``weakest_range``'s order); so nodes with more memory take more layers, and a mesh of nodes with
different memory splits a model in proportion to what each holds. Where every layer is served
already, a node's share also follows its measured speed (``relative_speed``: its step time measured on
a few of the model's own layers, against what the mesh's nodes advertise for their ranges), so a node
half as fast as the others takes half as many layers. docs/fetch.md says it for users.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.errors import InputError

#: of the memory available, what a node takes by default
DEFAULT_SHARE = 0.8
#: of a node's budget, kept for the KV cache and compute buffers
KV_SHARE = 0.25
#: the node process without weights (Python, grpc, llama.cpp's runtime), bytes
BASE = 300 << 20


@dataclass(frozen=True)
class Weights:
    """Weight bytes per layer, and what a head (token table) and a tail (lm_head, output norm) add;
    ``shared``: bytes both count (a tied model's token table is its lm_head), counted once in a whole."""

    per: tuple[int, ...]
    head: int
    tail: int
    shared: int = 0


def layer_bytes(tensors: Sequence[tuple[str, int]], n_layer: int) -> Weights:
    """``Weights`` from ``(tensor name, bytes)``."""
    per = [0] * n_layer
    head = tail = shared = 0
    tied = not any(t == "output.weight" for t, _ in tensors)
    for name, n in tensors:
        if name.startswith("blk."):
            idx = name[4:].split(".", 1)[0]
            if idx.isdigit() and int(idx) < n_layer:
                per[int(idx)] += n
        elif name == "token_embd.weight":
            head += n
            if tied:  # the tail's lm_head
                tail += n
                shared = n
        elif name.startswith("output"):
            tail += n
    return Weights(tuple(per), head, tail, shared)


def weights_budget(memory: int) -> int:
    return int(memory * (1 - KV_SHARE)) - BASE


def need(w: Weights, start: int, end: int) -> int:
    """Weight bytes of the range [start, end)."""
    whole = start == 0 and end == len(w.per)
    return (sum(w.per[start:end]) + (w.head if start == 0 else 0) + (w.tail if end == len(w.per) else 0)
            - (w.shared if whole else 0))


def target_span(replicas: Sequence[int]) -> int:
    """How many layers a node would take with memory to spare: the longest stretch of layers nobody
    serves, or half the model when every layer is served (a replica of the thinner half)."""
    longest = run = 0
    for r in replicas:
        run = run + 1 if r == 0 else 0
        longest = max(longest, run)
    return longest or max(len(replicas) // 2, 1)


#: nodes within this factor of each other's speed count as equally fast (measurements are noisy: a node
#: measures its range while its neighbours start, and a head's step also looks its token rows up)
SAME_SPEED = 1.5


def relative_speed(mine: tuple[float, float], peers: Sequence[tuple[int, float]]) -> float:
    """How fast this node is against the mesh's nodes: for each peer ``(weight bytes a decode step of
    its range computes, seconds it takes)``, its time over what this node's ``(fixed seconds, seconds
    per weight byte)`` predicts for that many bytes; the median (1.0 when unknown, and when within
    ``SAME_SPEED`` of 1)."""
    fixed, per_byte = mine
    ratios = sorted(t / (fixed + n * per_byte) for n, t in peers if n > 0 and t > 0 and fixed + n * per_byte > 0)
    if not ratios:
        return 1.0
    r = ratios[(len(ratios) - 1) // 2]  # the lower median: a peer that looks slow is never the only witness
    return 1.0 if 1 / SAME_SPEED <= r <= SAME_SPEED else r


def compute_bytes(w: Weights, start: int, end: int) -> int:
    """Weight bytes a decode step of [start, end) streams through: its blocks, and a tail's lm_head (a
    head's token table is not: it looks one row up)."""
    return sum(w.per[start:end]) + (w.tail if end == len(w.per) else 0)


def peer_steps(w: Weights, peers: Sequence[tuple[int, int, float]]) -> list[tuple[int, float]]:
    """``(start, end, seconds a step)`` of peers -> ``(bytes a step computes, seconds)`` for
    ``relative_speed``; heads only when there is no other peer (a head's step also looks its token rows
    up, which the probe, a middle range, does not)."""
    n = len(w.per)
    fair = [(a, b, t) for a, b, t in peers if 0 < a < b <= n] or list(peers)  # heads also look rows up: last
    return [(compute_bytes(w, a, b), t) for a, b, t in fair if 0 <= a < b <= n]


def speed_span(most: int, n: int, speed: float, gap: bool) -> int:
    """Where every layer is served already, a node takes layers in proportion to its speed: ``most``
    (half the model) times its relative speed, 1 to ``n``. A stretch nobody serves is taken whole
    whatever the speed (a slow node is better than a gap), as far as memory allows."""
    if gap:
        return most
    return max(1, min(n, round(most * speed)))


def sized_range(replicas: Sequence[int], w: Weights, memory: int, span: int = 0,
                speed: float = 1.0) -> tuple[int, int]:
    """The range to take: ``span`` layers (default ``target_span``, scaled by ``speed`` where the mesh
    has no gap), fewer if the weights of no such window fit ``memory``'s weight budget, placed where
    the mesh covers least. InputError if not one layer fits."""
    n = len(w.per)
    budget = weights_budget(memory)
    most = span or speed_span(target_span(replicas), n, speed, gap=min(replicas, default=0) == 0)
    if not 0 < most <= n:
        raise InputError(f"a span of {most} layers does not fit a model of {n}")
    for s in range(most, 0, -1):
        fits = [a for a in range(n - s + 1) if need(w, a, a + s) <= budget]
        if fits:
            a = min(fits, key=lambda a: (min(replicas[a : a + s]), sum(replicas[a : a + s]), a))
            return a, a + s
    smallest = min(need(w, a, a + 1) for a in range(n))
    raise InputError(f"not one layer fits this node's memory: {memory >> 20} MB leaves {max(budget, 0) >> 20} MB "
                     f"for weights, the smallest layer needs {smallest >> 20} MB (give more --memory)")


def available_memory(meminfo: str, cgroup_limit: int | None, cgroup_usage: int) -> int:
    """What this process may still use: MemAvailable, or less if its cgroup's limit leaves less."""
    avail = 0
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    if cgroup_limit is not None and cgroup_limit > 0:
        room = max(cgroup_limit - cgroup_usage, 0)
        avail = min(avail, room) if avail else room
    return avail
