"""How a node's llama.cpp threads wait: libgomp's spin, set before llama.cpp loads.

llama-cpp-python's llama.cpp is built with OpenMP (libggml-cpu links libgomp),
so a ``llama_decode`` on n threads is one OpenMP parallel region, and ggml's
barriers between a graph's operations are OpenMP barriers. libgomp makes a
waiting thread spin ``GOMP_SPINCOUNT`` rounds before it sleeps, both at those
barriers and, once the region is over, while it waits for the next one. Its
default (300,000 rounds, ~3 ms) suits one process that has the machine to
itself, as the whole model in ``Llama`` does. It does not suit two hops of a
route on one machine: the hop that just finished keeps a core spinning for
milliseconds while the next hop computes on all of them. Measured on 2 vCPUs
with a bare pipe between head and tail (``python -m bench.interference
--threads 2 [--spin N]``; docs/performance.md, "Threads"): 42 tok/s with the
default spin, 70-89 with 10,000 rounds (~0.1 ms), beside 76-87 for the whole
model.

A node's decode steps run on the data plane's thread (two thread wake-ups a
step and hop fewer than on the executor's worker) while its prompt chunks run
on the worker: two threads that each own a team. libgomp then counts more
threads than cores and cuts every wait to its *throttled* spin, 100 rounds
when ``OMP_WAIT_POLICY`` is unset: every barrier of every graph sleeps and
wakes (measured: 140 context switches a token, decode at a third of its
speed). With ``OMP_WAIT_POLICY=active`` the throttled spin is
``min(1000, GOMP_SPINCOUNT)``, so the node sets the policy and 1,000 rounds
(~10 µs): one spin whether it owns one team or two, long enough for a barrier
between two operations of a graph, short enough that a hop's idle threads
sleep while the next hop computes. Measured in turn on the 1.34 GB model
(``python -m bench.nodeenv``): 1,000 rounds alone changes nothing against
10,000 (0.861 vs 0.867 of the whole model); with decode steps on the data
plane 0.901, ahead in each of 4 rounds.

libgomp reads these variables once, when it is loaded (``import llama_cpp``),
so ``configure`` runs at the very start of a node process; values the user
set are kept, and ``teams_keep_their_spin`` tells the executor whether a
second team is safe under them.
"""

from __future__ import annotations

import logging
import os
import sys

#: libgomp spin rounds before a waiting thread sleeps (~10 µs): long enough for a barrier between two
#: operations of one graph, short enough that a hop's idle threads are asleep before the next hop computes;
#: at most what libgomp's throttled spin allows under ``OMP_WAIT_POLICY=active`` (1,000)
SPIN_ROUNDS = 1_000
#: the wait policy under which a second OpenMP team keeps (nearly) the same spin as one
WAIT_POLICY = "active"

log = logging.getLogger("meshnode.node")


def configure(decode_threads: int, environ: dict[str, str] | None = None) -> str | None:
    """For a node that decodes on several threads, set ``GOMP_SPINCOUNT`` and ``OMP_WAIT_POLICY`` unless
    the user did; returns the spin in force (None: libgomp's default). A single-threaded decode starts no
    OpenMP team, and prompt chunks are long enough that the default spin costs nothing there.

    Too late once llama.cpp is loaded (libgomp has read its environment): logged, not raised.
    """
    env = os.environ if environ is None else environ
    if decode_threads <= 1:
        return env.get("GOMP_SPINCOUNT")
    value = env.setdefault("GOMP_SPINCOUNT", str(SPIN_ROUNDS))
    env.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    if environ is None and "llama_cpp" in sys.modules:
        log.warning("llama.cpp was loaded before GOMP_SPINCOUNT was set; its threads spin libgomp's default")
    return value


def teams_keep_their_spin(environ: dict[str, str] | None = None) -> bool:
    """Whether a second OpenMP team in this process leaves libgomp's waits as they are: under a wait policy
    (active: the throttled spin is min(1000, GOMP_SPINCOUNT); passive: no spin to cut). Unset, libgomp cuts
    every wait to 100 rounds as soon as two threads own teams."""
    env = os.environ if environ is None else environ
    return env.get("OMP_WAIT_POLICY", "").strip().lower() in ("active", "passive")
