"""Which cuts of which architectures execute exactly: pure decisions.

A range [a, b) of a model is executed by llama.cpp as a model of b-a layers
(the slicer writes it as one; slicer.py). That is exact only when everything
in the graph that depends on a layer's absolute index, on the model's layer
count or on the kind of input (token ids or embeddings) is carried into the
slice explicitly. ``ArchPolicy`` says, per architecture, what that is, read
from llama.cpp's ``src/models/<file>.cpp`` at the pinned build (the table is
``archtable.py``, one entry per architecture with its citation); the
decisions here are functions of (metadata, policy, range) only:

* ``boundary_verdicts``: for every layer boundary, None (a cut there is
  exact) or the reason it is not;
* ``check_cut``: refuse (``CutRefusedError``) a range that would not execute
  exactly, with that reason;
* ``swa_layers`` / ``slice_kv``: the metadata a slice carries so that it
  computes what its layers compute inside the whole model.

The whole model [0, n_layer) is the file itself: always exact, any
architecture. Everything not in the table is refused, never served
approximately.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshnode.errors import CutRefusedError, LayerRangeError, ModelFormatError

Meta = Mapping[str, Any]


class InputScale(enum.Enum):
    """What the graph does to its input before layer 0 (``build_inp_embd`` and the lines after it)."""

    #: embeddings enter layer 0 unchanged
    NONE = "none"
    #: token input only is multiplied by sqrt(n_embd) (gemma3: ``ubatch.token ? sqrtf(n_embd) : 1.0f``):
    #: the head looks its token rows up itself and applies the same float32 scale
    TOKENS_SQRT_EMBD = "tokens-sqrt-embd"
    #: any input is multiplied by sqrt(n_embd) (gemma2: ``ggml_scale(inpL, sqrtf(n_embd))``, named
    #: ``inp_scaled``): a non-head hop puts its input back into ``inp_scaled`` (native/capture.c)
    ALL_SQRT_EMBD = "all-sqrt-embd"
    #: any input is multiplied by ``{arch}.embedding_scale`` (llama-graph.cpp ``build_inp_embd``:
    #: ``f_embedding_scale != 0 && (ubatch.token || n_deepstack_layers == 0)``): non-head slices
    #: declare a scale of 0, which llama.cpp reads as "no scale"
    EMBEDDING_SCALE_KEY = "embedding-scale-key"


class Output(enum.Enum):
    """How the loader finds the lm_head (``load_arch_tensors``)."""

    #: ``output.weight`` if present, else ``token_embd`` placed as the output (TENSOR_DUPLICATED)
    OPTIONAL = "optional"
    #: ``output.weight`` is required (flags 0): non-tail slices carry a one-row stand-in
    REQUIRED = "required"
    #: always ``token_embd`` (the loader never reads ``output.weight``)
    TIED = "tied"


@dataclass(frozen=True)
class Swa:
    """A sliding-window (or chunked-attention) pattern of the absolute layer index.

    Every graph in the table that has one reads it through ``load_swa_pattern``
    (llama-model.cpp), which takes an explicit per-layer array from
    ``{arch}.attention.sliding_window_pattern`` before any default: so a slice
    carries its layers' flags as such an array.
    """

    #: the default period: ``load_swa_pattern(ml, period, dense_first)`` -> ``set_swa_pattern``
    period: int
    dense_first: bool = False
    #: the graph is windowed whatever the file says (gemma2, cohere2, gpt-oss, llama4's chunks);
    #: else only when ``{arch}.attention.sliding_window`` > 0 (gemma3, olmo2)
    always: bool = False


#: (meta, n_layer) -> {boundary: reason} for boundaries that cannot be cut, beyond the generic rules
BoundaryRule = Callable[[Meta, str, int], dict[int, str]]
#: (meta, arch, n_layer, start, end) -> reason the range cannot execute exactly, or None
RangeRule = Callable[[Meta, str, int, int, int], str | None]
#: (meta, arch, n_layer, start, end) -> metadata the slice must state explicitly {key: value}
ResolvedKV = Callable[[Meta, str, int, int, int], dict[str, Any]]


@dataclass(frozen=True)
class ArchPolicy:
    arch: str
    #: the llama.cpp file(s) (under ``src/``, pinned build) these decisions are read from
    source: str = ""
    input_scale: InputScale = InputScale.NONE
    #: the window pattern, None if the graph has none (a file declaring one is then refused,
    #: unless ``swa_ignored``)
    swa: Swa | None = None
    #: the loader ignores a declared window (phi3: ``swa_type = LLAMA_SWA_TYPE_NONE``)
    swa_ignored: bool = False
    output: Output = Output.OPTIONAL
    #: ``{arch}.leading_dense_block_count`` (dense FFN in layers below it, MoE above) is per slice
    dense_lead: bool = False
    #: layer counts whose model type changes numerics: a whole model or a slice of such a count
    #: cannot stand in for the other (gemma3 27B's attention scale, from its 62 layers)
    layer_count_dependent: frozenset[int] = frozenset()
    #: arch-specific boundaries that cannot be cut
    boundary_rule: BoundaryRule | None = None
    #: arch-specific ranges that cannot execute exactly
    range_rule: RangeRule | None = None
    #: metadata whose value the whole model derives from its layer count, stated in every slice
    resolved_kv: ResolvedKV | None = None
    #: a mixture-of-experts graph (for docs and ``model inspect``)
    moe: bool = False
    #: some layers keep a recurrent state instead of a KV cache: positions cannot be dropped from the end
    #: of a sequence (llama-memory-recurrent.cpp seq_rm), so a hop cannot roll back a rejected draft
    recurrent: bool = False
    #: what else was checked, for docs/models.md
    note: str = ""
    #: the models people run of this architecture (docs/models.md)
    families: str = ""
    #: the test that shows it (docs/models.md)
    test: str = ""

    @property
    def head_scales_by_sqrt_embd(self) -> bool:
        return self.input_scale is InputScale.TOKENS_SQRT_EMBD


@dataclass(frozen=True)
class Refused:
    """An architecture the pinned build loads but meshnode does not cut, and why."""

    arch: str
    reason: str
    source: str = ""
    families: str = ""


@dataclass
class Verdicts:
    """Per boundary k in 1..n_layer-1: None if a cut there is exact, else why not."""

    n_layer: int
    reasons: dict[int, str] = field(default_factory=dict)

    def reason(self, k: int) -> str | None:
        return self.reasons.get(k)

    @property
    def cuttable(self) -> list[int]:
        return [k for k in range(1, self.n_layer) if k not in self.reasons]


def _table() -> tuple[dict[str, ArchPolicy], dict[str, Refused]]:
    from meshnode.gguf import archtable  # the table cites this module's types

    return archtable.POLICIES, archtable.REFUSED


def policy_for(arch: str) -> ArchPolicy:
    policies, refused = _table()
    if arch in policies:
        return policies[arch]
    if arch in refused:
        raise CutRefusedError(
            f"architecture {arch!r} cannot be cut exactly: {refused[arch].reason}; it can still run whole")
    raise CutRefusedError(
        f"architecture {arch!r} is not one meshnode can cut exactly "
        f"(supported: {', '.join(sorted(policies))}); it can still run whole"
    )


def check_range(start: int, end: int, n_layer: int) -> None:
    if not 0 <= start < end <= n_layer:
        raise LayerRangeError(
            f"layer range {start}:{end} is not a non-empty part of [0, {n_layer})"
        )


def meta_int(meta: Meta, key: str, default: int = 0) -> int:
    """An integer hyperparameter, ``default`` when absent; ModelFormatError when it is anything but a
    non-negative integer (the file is hostile or damaged: no decision is made on it)."""
    v = meta.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ModelFormatError(f"{key} is {v!r}, not a non-negative integer")
    return v


def n_layer_of(meta: Meta, arch: str) -> int:
    """The layers a route covers: ``block_count`` less the next-token-prediction blocks
    (``n_layer() = n_layer_all - n_layer_nextn``, llama-hparams.cpp), which only drafting uses."""
    return meta_int(meta, f"{arch}.block_count") - meta_int(meta, f"{arch}.nextn_predict_layers")


def window(meta: Meta, arch: str) -> int:
    w = meta.get(f"{arch}.attention.sliding_window")
    return int(w) if isinstance(w, int) and not isinstance(w, bool) else 0


def swa_layers(meta: Meta, arch: str, n_layer: int, policy: ArchPolicy | None = None) -> list[bool] | None:
    """The per-layer window flags of the whole model as llama.cpp computes them, or None if it has none."""
    if policy is None:
        policy = _table()[0].get(arch)
    declared = window(meta, arch)
    swa = policy.swa if policy is not None else None
    if swa is None or policy is None or policy.swa_ignored:
        return None
    if not swa.always and declared <= 0:
        return None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) < n_layer:
            raise CutRefusedError(f"{arch} sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
        return [bool(x) for x in pattern[:n_layer]]
    period = int(pattern) if isinstance(pattern, int) and not isinstance(pattern, bool) else swa.period
    if swa.dense_first:  # llama_hparams::set_swa_pattern
        return [period == 0 or il % period != 0 for il in range(n_layer)]
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]


def boundary_verdicts(meta: Meta, arch: str, n_layer: int) -> Verdicts:
    """Why each boundary of the whole model can or cannot be cut (for ``check_cut`` and ``model inspect``)."""
    v = Verdicts(n_layer)
    try:
        policy = policy_for(arch)
    except CutRefusedError as e:
        v.reasons = dict.fromkeys(range(1, n_layer), str(e))
        return v
    everywhere = _model_reason(meta, arch, n_layer, policy)
    if everywhere:
        v.reasons = dict.fromkeys(range(1, n_layer), everywhere)
        return v
    v.reasons.update(_windowless_side(meta, arch, n_layer, policy))
    if policy.boundary_rule is not None:
        v.reasons.update(policy.boundary_rule(meta, arch, n_layer))
    return v


def _windowless_side(meta: Meta, arch: str, n_layer: int, policy: ArchPolicy) -> dict[int, str]:
    """Boundaries k where every range ending at k, or every range starting at k, holds no
    sliding-window layer: an always-windowed graph cannot load it (``check_cut``), so no route
    can cut there (gemma2's or gpt-oss's last layer, global in a model of an even layer count)."""
    flags = swa_layers(meta, arch, n_layer, policy)
    if flags is None or policy.swa is None or not policy.swa.always:
        return {}
    out: dict[int, str] = {}
    for k in range(1, n_layer):
        side = "below" if not any(flags[:k]) else "from" if not any(flags[k:]) else None
        if side is not None:
            out[k] = (f"the layers {side} it hold no sliding-window layer, and llama.cpp's {arch} graph "
                      "always builds a windowed cache, which it refuses without one (GGML_ASSERT(is_swa_any()))")
    return out


def _model_reason(meta: Meta, arch: str, n_layer: int, policy: ArchPolicy) -> str | None:
    """A reason no partial range of this model is exact, or None."""
    if n_layer in policy.layer_count_dependent:
        return (f"{arch} with {n_layer} layers chooses numerics (its attention scale) from its layer count; "
                "a slice with fewer layers would compute differently")
    if window(meta, arch) > 0 and policy.swa is None and not policy.swa_ignored:
        return f"{arch} declares a sliding window, which llama.cpp's {arch} graph does not read per layer"
    return None


def check_cut(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> ArchPolicy:
    """Refuse (CutRefusedError/LayerRangeError) unless [start, end) executes exactly."""
    check_range(start, end, n_layer)
    if start == 0 and end == n_layer:
        # the whole model is the file itself: always exact, any architecture
        return _table()[0].get(arch) or ArchPolicy(arch)
    verdicts = boundary_verdicts(meta, arch, n_layer)
    for k in (start, end):
        reason = verdicts.reason(k)
        if reason is not None:
            raise CutRefusedError(f"cannot cut {arch} at layer {k}: {reason}")
    policy = policy_for(arch)
    if (end - start) in policy.layer_count_dependent:
        raise CutRefusedError(
            f"a {end - start}-layer slice of {arch} would take the numerics llama.cpp picks for a whole "
            f"{end - start}-layer {arch} model, not those of this {n_layer}-layer one"
        )
    flags = swa_layers(meta, arch, n_layer, policy)
    if flags is not None and policy.swa is not None and policy.swa.always and not any(flags[start:end]):
        raise CutRefusedError(
            f"layers {start}:{end} of {arch} hold no sliding-window layer, and llama.cpp's {arch} graph "
            "always builds a windowed cache, which it refuses without one (GGML_ASSERT(is_swa_any()))"
        )
    if policy.range_rule is not None:
        reason = policy.range_rule(meta, arch, n_layer, start, end)
        if reason is not None:
            raise CutRefusedError(f"cannot cut {arch} to layers {start}:{end}: {reason}")
    return policy


def slice_kv(meta: Meta, arch: str, n_layer: int, start: int, end: int, *,
             head: bool) -> tuple[dict[str, Any], set[str]]:
    """Metadata a slice of [start, end) sets (key -> value) and drops, beyond the generic slicing.

    The generic part (slicer.py): ``block_count``, per-layer arrays cut to the
    range, a stand-in vocabulary for non-tail ranges. Here: what the policy
    says depends on the absolute index, the layer count or the input kind.
    ``head``: the range takes token ids (start == 0).
    """
    policy = policy_for(arch)
    put: dict[str, Any] = {}
    drop: set[str] = set()
    flags = swa_layers(meta, arch, n_layer, policy)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    if flags is not None:
        if any(flags[start:end]):
            put[pattern_key] = flags[start:end]
        else:
            # only global layers: a graph windowed by its key declares no window at all, which
            # computes the same (else llama.cpp asserts is_swa_any() in create_memory)
            drop |= {pattern_key, f"{arch}.attention.sliding_window"}
    nextn = f"{arch}.nextn_predict_layers"
    if nextn in meta:
        drop.add(nextn)  # next-token-prediction blocks are not part of any range (only drafting uses them)
    if policy.dense_lead:
        key = f"{arch}.leading_dense_block_count"
        lead = meta_int(meta, key)
        put[key] = min(max(lead - start, 0), end - start)
    if policy.input_scale is InputScale.EMBEDDING_SCALE_KEY and not head:
        put[f"{arch}.embedding_scale"] = 0.0
    if policy.resolved_kv is not None:
        put.update(policy.resolved_kv(meta, arch, n_layer, start, end))
    return put, drop
