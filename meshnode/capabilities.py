"""What a node has: CPU, memory, llama.cpp devices, its range's measured throughput, and the signed
capability that says so."""

from __future__ import annotations

import hashlib
import os
import re
import statistics
import time
from pathlib import Path

import llama_cpp
import numpy as np

from meshnode import __version__
from meshnode.executor import _bindings
from meshnode.executor._llama import LlamaRange
from meshnode.executor.config import ExecConfig
from meshnode.gguf.slicer import RangeArtifact, Role
from meshnode.identity import NodeIdentity
from meshnode.identity.attest import attest
from meshnode.proto import node_pb2 as pb
from meshnode.session.hop import HopLimits
from meshnode.wire import codec
from meshnode.wire.schema import SCHEMA_VERSION, SERVICE_NAME


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_features(system_info: str) -> list[str]:
    """Features llama.cpp reports as built in and used ('AVX2 = 1 | ...'). Pure."""
    return [m.group(1) for m in re.finditer(r"([A-Z0-9_]+) = 1", system_info)]


def host_id() -> str:
    """One value per running machine: a hash of the kernel's boot id (it says nothing else of the
    machine; a reboot changes it). Nodes in containers of one host share it."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return hashlib.sha256(b"meshnode host\0" + boot.encode()).hexdigest()[:16]


def hardware(config: ExecConfig | None = None) -> pb.Hardware:
    """The machine, and (with ``config``) how many threads this node computes on."""
    mem = _meminfo()
    return pb.Hardware(
        cpu_model=_cpu_model(),
        cores=os.cpu_count() or 1,
        cpu_features=cpu_features(_bindings.system_info()),
        memory_total_bytes=mem.get("MemTotal", 0),
        memory_available_bytes=mem.get("MemAvailable", 0),
        devices=[pb.Device(**d) for d in _bindings.backend_devices()],
        host_id=host_id(),
        cpus=sorted(os.sched_getaffinity(0)),
        decode_threads=config.n_threads if config else 0,
        batch_threads=config.n_threads_batch if config else 0,
    )


#: the warm-up before timing: a short prefill and a few decode steps, untimed
WARMUP_TOKENS, WARMUP_STEPS = 16, 2
#: seconds of timed runs after the first, at most: on a busy machine a node still starts promptly
RUN_BUDGET = 0.5


def measure_throughput(rng: LlamaRange, *, prefill_tokens: int = 32, decode_steps: int = 4, runs: int = 3,
                       budget: float = RUN_BUDGET) -> pb.Throughput:
    """The range's single-session speed, measured warm on its last slot, then freed. Blocking.

    A cold first run pays for paging the weights in and sizing llama.cpp's
    compute buffers, and a node often measures while its neighbours start up:
    so an untimed warm-up comes first, then up to ``runs`` timed runs (a
    prefill of ``prefill_tokens`` from position 0, then ``decode_steps``
    single-token steps; runs after the first only while ``budget`` seconds
    last), and each figure is the median (of the prefills; of all decode
    steps). About 0.3 s on an idle machine for SmolLM2's halves.
    """
    seq = rng.config.max_sessions - 1
    n = max(1, min(prefill_tokens, rng.config.n_batch, rng.n_ctx_seq - decode_steps))

    def step(pos: int, k: int) -> float:
        t0 = time.perf_counter()
        if rng.takes_tokens:
            rng.forward(seq, pos, tokens=np.zeros(k, dtype=np.int32))
        else:
            rng.forward(seq, pos, embd=np.zeros((k, rng.n_embd), dtype=np.float32))
        return time.perf_counter() - t0

    prefills: list[float] = []
    decodes: list[float] = []
    try:
        warm = min(WARMUP_TOKENS, n)
        step(0, warm)
        for i in range(min(WARMUP_STEPS, rng.n_ctx_seq - warm)):
            step(warm + i, 1)
        start = time.perf_counter()
        while len(prefills) < max(runs, 1) and (not prefills or time.perf_counter() - start < budget):
            rng.release(seq)
            prefills.append(step(0, n))
            decodes.extend(step(n + i, 1) for i in range(decode_steps))
    finally:
        rng.release(seq)
    return pb.Throughput(decode_tokens_per_second=1.0 / statistics.median(decodes or [float("inf")]),
                         prefill_tokens_per_second=n / statistics.median(prefills))


LLAMA_BUILD = f"llama-cpp-python {llama_cpp.__version__}"


def capability(artifact: RangeArtifact, config: ExecConfig, limits: HopLimits, ident: NodeIdentity,
               *, now: int | None = None, hardware: pb.Hardware | None = None,
               throughput: pb.Throughput | None = None, endpoints: list[str] | None = None,
               insecure: bool = False) -> pb.Capability:
    src = artifact.manifest["source"]
    envelope = attest(ident, fingerprint=artifact.fingerprint, start=artifact.start, end=artifact.end,
                      range_digest=artifact.range_digest, llama_build=LLAMA_BUILD,
                      now=int(time.time()) if now is None else now)
    return pb.Capability(
        schema_version=SCHEMA_VERSION,
        service=SERVICE_NAME,
        node_version=__version__,
        model_fingerprint=artifact.fingerprint,
        model_name=src["name"],
        model_file=Path(src["file"]).name,
        arch=src["arch"],
        n_layer=src["n_layer"],
        n_embd=src["n_embd"],
        range=pb.LayerRange(start=artifact.start, end=artifact.end),
        range_digest=artifact.range_digest,
        role=artifact.role.value,
        has_vocab=artifact.role in (Role.TAIL, Role.WHOLE),
        numerics=codec.numerics_to_pb(config),
        limits=pb.FlowLimits(max_chunk_bytes=limits.max_chunk_bytes,
                             max_prefill_chunk_tokens=min(limits.max_prefill_chunk_tokens, config.n_batch),
                             credits=limits.credits),
        max_sessions=config.max_sessions,
        llama_build=LLAMA_BUILD,
        node_id=ident.node_id,
        attestation=envelope,
        hardware=hardware,
        throughput=throughput,
        endpoints=endpoints or [],
        insecure=insecure,
    )
