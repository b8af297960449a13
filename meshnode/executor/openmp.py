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

libgomp reads the variable once, when it is loaded (``import llama_cpp``), so
``configure`` runs at the very start of a node process; a value the user set
is kept.
"""

from __future__ import annotations

import logging
import os
import sys

#: libgomp spin rounds before a waiting thread sleeps (~0.1 ms): long enough for a barrier between two
#: operations of one graph, short enough that a hop's idle threads are asleep before the next hop computes
SPIN_ROUNDS = 10_000

log = logging.getLogger("meshnode.node")


def configure(decode_threads: int, environ: dict[str, str] | None = None) -> str | None:
    """For a node that decodes on several threads, set ``GOMP_SPINCOUNT`` unless the user did; returns
    the value in force (None: libgomp's default). A single-threaded decode starts no OpenMP team, and
    prompt chunks are long enough that the default spin costs nothing there.

    Too late once llama.cpp is loaded (libgomp has read its environment): logged, not raised.
    """
    env = os.environ if environ is None else environ
    if decode_threads <= 1:
        return env.get("GOMP_SPINCOUNT")
    value = env.setdefault("GOMP_SPINCOUNT", str(SPIN_ROUNDS))
    if environ is None and "llama_cpp" in sys.modules:
        log.warning("llama.cpp was loaded before GOMP_SPINCOUNT was set; its threads spin libgomp's default")
    return value
