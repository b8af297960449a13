"""Which cuts of which architectures execute exactly: pure decisions.

A range [a, b) of a model is executed by llama.cpp as a model of b-a layers.
That is exact only when nothing in the graph depends on a layer's absolute
index or on the input arriving as token ids. What each supported graph does
(read from llama.cpp's ``src/models/*.cpp`` at the pinned build):

* llama, qwen2, qwen3: embeddings enter layer 0 unchanged; per-layer
  behaviour depends only on per-layer tensors. Every cut is exact, unless the
  file declares a sliding window (not handled for these graphs: refused).
* gemma3: token input is multiplied by sqrt(n_embd) (``ubatch.token ?
  sqrtf(n_embd) : 1.0f``), embeddings input is not; the head does its own
  token lookup, so it applies the same float32 scale itself. Sliding-window
  layers follow a pattern of the absolute index (every 6th global); a slice
  carries the pattern explicitly as a per-layer bool array. The 27B model
  picks its attention scale from its layer count (62), which a slice cannot
  reproduce: refused.

All four load ``output.weight`` as optional and, when it is absent, take
``token_embd`` as the lm_head (``load_arch_tensors``: ``create_tensor(...
TOKEN_EMBD ..., TENSOR_DUPLICATED)``). The loader then places that
duplicate as the output tensor it stands for (``llama_model_loader::
create_tensor`` looks it up as ``LLM_TENSOR_OUTPUT``: the output layer's
buffer list, ``GGML_OP_MUL_MAT``), so it gets the buffer type, and so the
matmul kernel (e.g. CPU_REPACK for Q4_0 on AVX2), that a real
``output.weight`` of the same type and shape gets. A tail of an untied model
therefore carries its output matrix as its ``token_embd`` and no second
vocabulary-sized matrix (``output_falls_back_to_token_embd``; slicer.py).

Everything else is refused with the reason, never served approximately.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshnode.errors import CutRefusedError, LayerRangeError


@dataclass(frozen=True)
class ArchPolicy:
    arch: str
    #: the head multiplies looked-up token embeddings by sqrt(n_embd)
    head_scales_by_sqrt_embd: bool
    #: the graph has a sliding-window pattern of the absolute layer index
    swa_pattern: bool
    #: layer counts whose whole model uses numerics a slice cannot reproduce
    layer_count_dependent: frozenset[int] = frozenset()
    #: without output.weight the loader takes token_embd as the lm_head, placed as the output tensor
    output_falls_back_to_token_embd: bool = False


POLICIES: dict[str, ArchPolicy] = {
    "llama": ArchPolicy("llama", head_scales_by_sqrt_embd=False, swa_pattern=False,
                        output_falls_back_to_token_embd=True),
    "qwen2": ArchPolicy("qwen2", head_scales_by_sqrt_embd=False, swa_pattern=False,
                        output_falls_back_to_token_embd=True),
    "qwen3": ArchPolicy("qwen3", head_scales_by_sqrt_embd=False, swa_pattern=False,
                        output_falls_back_to_token_embd=True),
    "gemma3": ArchPolicy(
        "gemma3",
        head_scales_by_sqrt_embd=True,
        swa_pattern=True,
        layer_count_dependent=frozenset({62}),
        output_falls_back_to_token_embd=True,
    ),
}

#: gemma3's default pattern: il % 6 < 5 is sliding-window (llama-hparams.cpp)
GEMMA3_SWA_PERIOD = 6


def policy_for(arch: str) -> ArchPolicy:
    try:
        return POLICIES[arch]
    except KeyError:
        raise CutRefusedError(
            f"architecture {arch!r} is not one meshnode can cut exactly "
            f"(supported: {', '.join(sorted(POLICIES))}); it can still run whole"
        ) from None


def check_range(start: int, end: int, n_layer: int) -> None:
    if not 0 <= start < end <= n_layer:
        raise LayerRangeError(
            f"layer range {start}:{end} is not a non-empty part of [0, {n_layer})"
        )


def swa_layers(meta: Mapping[str, Any], arch: str, n_layer: int) -> list[bool] | None:
    """The per-layer sliding-window flags of the whole model, or None if it has none."""
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        return None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise CutRefusedError(f"{arch} sliding_window_pattern has {len(pattern)} entries")
        return [bool(x) for x in pattern]
    period = int(pattern) if isinstance(pattern, int) else GEMMA3_SWA_PERIOD
    return [period == 0 or (il % period < period - 1) for il in range(n_layer)]


def check_cut(meta: Mapping[str, Any], arch: str, n_layer: int, start: int, end: int) -> ArchPolicy:
    """Refuse (CutRefusedError/LayerRangeError) unless [start, end) executes exactly."""
    check_range(start, end, n_layer)
    if start == 0 and end == n_layer:
        # the whole model is the file itself: always exact, any architecture
        return POLICIES.get(arch, ArchPolicy(arch, False, False))
    policy = policy_for(arch)
    if n_layer in policy.layer_count_dependent or (end - start) in policy.layer_count_dependent:
        raise CutRefusedError(
            f"{arch} with {n_layer} layers chooses its attention scale from its layer count; "
            f"a {end - start}-layer slice would compute differently"
        )
    if meta.get(f"{arch}.attention.sliding_window") and not policy.swa_pattern:
        raise CutRefusedError(
            f"{arch} declares a sliding window, which meshnode does not cut for this graph"
        )
    return policy
