"""The per-session context (``--ctx-size``): its default, and the check that a prompt fits.

The context does not change numerics: llama.cpp's attention runs over a
sequence's used cells, padded to 256, whatever the cache's size (measured on
SmolLM2: logits at ``n_ctx`` 512, 2048 and 8192 identical, max difference
0.0). So hops of a route may differ in it; a route's context is its smallest
hop's, and a prompt that does not fit is refused naming the flag.

One exception: a model with LongRoPE factor pairs (phi3's ``rope_factors_long``
/ ``rope_factors_short``) takes the long ones when a context's per-sequence
size exceeds the original context (llama-model.cpp ``get_rope_factors``:
``n_ctx_seq > hparams.n_ctx_orig_yarn``). Every hop of a route must choose
alike: ``resolve_ctx`` records the original context in the config
(``rope_ctx_orig``), the hop advertises it with its numerics, and a route whose
hops lie on different sides of it is refused (wire/codec.py ``numerics_key``),
naming the contexts; ``--ctx-size`` puts a node on the side wanted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from meshnode.errors import InputError
from meshnode.executor.config import ExecConfig
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import inspect_model

#: bytes of one K or V value in the cache: f16, llama.cpp's default cache type
KV_VALUE_BYTES = 2
#: the KV cache of all sessions may take at most 1/MEMORY_SHARE of the memory available at start-up
MEMORY_SHARE = 4
#: llama.cpp pads a sequence's cells to multiples of 256; a context is a multiple of it
CTX_ALIGN = 256
#: when the model does not state its training context
FALLBACK_CTX = 4096


def kv_bytes_per_token(kv_widths: Sequence[int]) -> int:
    """KV-cache bytes one token costs in a range: for each layer, n_embd_k_gqa + n_embd_v_gqa values, f16."""
    return sum(kv_widths) * KV_VALUE_BYTES


def default_ctx_size(n_ctx_train: int, kv_bytes_per_token: int, max_sessions: int, mem_available: int) -> int:
    """The default per-session context: the model's training context, within the memory budget. Pure.

    The rule: ``max_sessions`` sessions' KV caches (``kv_bytes_per_token`` per
    cell, for the layers this node runs) may take a quarter of the memory
    available at start-up; the context is the training context (4096 if
    unknown) or less to stay within that, rounded down to a multiple of 256,
    and never below 256. SmolLM2 whole, 4 sessions: 22.5 KiB a token, so
    8192 tokens take 720 MiB, and fit once 2.9 GiB are available.
    """
    want = n_ctx_train if n_ctx_train > 0 else FALLBACK_CTX
    if kv_bytes_per_token <= 0 or mem_available <= 0:
        return max(CTX_ALIGN, want // CTX_ALIGN * CTX_ALIGN)
    fits = mem_available // MEMORY_SHARE // (kv_bytes_per_token * max(1, max_sessions))
    return max(CTX_ALIGN, min(want, fits) // CTX_ALIGN * CTX_ALIGN)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes (0 if unknown), or less when this process's cgroup memory limit leaves less."""
    if meminfo == Path("/proc/meminfo"):
        from meshnode.executor.cpus import available_memory

        try:
            return available_memory()
        except (OSError, ValueError):
            pass
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check_fits(n_prompt: int, max_tokens: int, ctx: int, *, where: str = "") -> None:
    """InputError naming ``--ctx-size`` unless prompt + output fit the session context. Pure."""
    if n_prompt + max_tokens > ctx:
        raise InputError(
            f"the prompt ({n_prompt} tokens) + --max-tokens ({max_tokens}) exceed the session context of "
            f"{ctx} tokens{where}: raise --ctx-size (to at least {n_prompt + max_tokens}) or shorten the prompt"
        )


def long_rope_limit(range_path: Path) -> int | None:
    """The original context of a model with LongRoPE factor pairs (above it llama.cpp switches factors), else None."""
    meta = read_meta(range_path)
    if not any(t.name == "rope_factors_long.weight" for t in meta.tensors):
        return None
    arch = meta.get("general.architecture")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length") or meta.get(f"{arch}.context_length")
    return int(orig) if isinstance(orig, int) and orig > 0 else None


def resolve_ctx(config: ExecConfig, range_path: Path) -> ExecConfig:
    """``config`` with its per-session context decided (as given, or the default for this range file) and
    the file's LongRoPE original context recorded (``rope_ctx_orig``)."""
    orig = long_rope_limit(range_path) or 0
    if config.n_ctx_per_session > 0:
        return dataclasses.replace(config, rope_ctx_orig=orig)
    info = inspect_model(range_path)  # metadata only, ~10 ms
    ctx = default_ctx_size(info.n_ctx_train, kv_bytes_per_token(info.kv_widths), config.max_sessions,
                           mem_available())
    return dataclasses.replace(config, n_ctx_per_session=ctx, rope_ctx_orig=orig)
