"""2026's families and hybrids (gemma4, qwen3next, ...), and every other architecture the pinned build loads."""

from __future__ import annotations

from typing import Any

from meshnode.gguf.arch import ArchPolicy, InputScale, Meta, Refused, Swa

# -- gemma4 ----------------------------------------------------------------------------

def _int(meta: Meta, key: str) -> int:
    v = meta.get(key)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


def _gemma4_kv_from(meta: Meta, arch: str, n_layer: int) -> int:
    """gemma4.cpp: ``n_layer_kv_from_start = n_layer_all - shared_kv_layers``: layers from there on
    keep no KV and read layer ``kv_from - 2`` (local) or ``kv_from - 1`` (global) (llama-model.cpp
    ``create_memory``, the ``reuse`` callback of GEMMA3N/GEMMA4)."""
    return n_layer - _int(meta, f"{arch}.attention.shared_kv_layers")


_ONE_LAYER = ("llama.cpp's gemma4 cache asserts n_layer_kv_from_start >= 2 (the reuse callback in "
              "create_memory), so a 1-layer slice aborts on load")
_NO_GLOBAL = ("gemma4 files carry rope_freqs (conversion/gemma.py, generate_extra_tensors), which the loader "
              "reads only for global layers (gemma4.cpp load_arch_tensors): a slice without one holds an unread "
              "tensor, which llama.cpp refuses (done_getting_tensors: wrong number of tensors)")
_NO_LOCAL = ("gemma4.cpp always builds a windowed cache (build_attn_inp_kv_iswa), which llama.cpp refuses "
             "without a sliding-window layer (GGML_ASSERT(is_swa_any()))")


def _gemma4_flags(meta: Meta, arch: str, n_layer: int) -> list[bool]:
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    return [bool(x) for x in pattern[:n_layer]] if isinstance(pattern, list) else [True] * n_layer


def _gemma4_slice_reason(flags: list[bool], start: int, end: int) -> str | None:
    """Why a slice of these layers would not load (or would compute otherwise), or None."""
    if end - start < 2:
        return _ONE_LAYER
    if all(flags[start:end]):
        return _NO_GLOBAL
    if not any(flags[start:end]):
        return _NO_LOCAL
    return None


def _gemma4_boundaries(meta: Meta, arch: str, n_layer: int) -> dict[int, str]:
    per_layer = _int(meta, f"{arch}.embedding_length_per_layer_input")
    if per_layer > 0:
        ple = ("gemma4 with per-layer embeddings (E2B/E4B) gives every layer an input computed from the token "
               "ids (per_layer_token_embd) and from layer 0's input (per_layer_model_proj, "
               "project_per_layer_inputs); a hop fed embeddings gets the padding row's instead "
               "(build_inp_per_layer: ubatch.token is null), and no hop but the first sees either")
        return dict.fromkeys(range(1, n_layer), ple)
    flags = _gemma4_flags(meta, arch, n_layer)
    out: dict[int, str] = {}
    kv_from = _gemma4_kv_from(meta, arch, n_layer)
    for k in range(1, n_layer):
        # a range ending at k starts at or after 0, one starting at k ends at or before n_layer
        why = _gemma4_slice_reason(flags, 0, k) or _gemma4_slice_reason(flags, k, n_layer)
        if why is None and kv_from - 1 <= k < n_layer:
            why = (f"layers {kv_from}..{n_layer - 1} of gemma4 keep no KV and attend with the KV of layers "
                   f"{kv_from - 2} and {kv_from - 1} (shared_kv_layers; create_memory's reuse callback): "
                   f"a cut must keep those in one range, at or before layer {kv_from - 2}")
        if why is not None:
            out[k] = why
    return out


def _gemma4_range(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> str | None:
    return _gemma4_slice_reason(_gemma4_flags(meta, arch, n_layer), start, end)


def _gemma4_kv(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> dict[str, Any]:
    """The slice's own count of KV-sharing layers: those of its layers at or past ``kv_from``."""
    kv_from = _gemma4_kv_from(meta, arch, n_layer)
    return {f"{arch}.attention.shared_kv_layers": max(0, end - max(start, kv_from))}


_GEMMA4_NOTE = (
    "gemma4.cpp: token input x sqrtf(n_embd), embeddings input not (``ubatch.token ? sqrtf(n_embd) : 1.0f``): "
    "the head scales its own lookup; windows from the required per-layer "
    "``attention.sliding_window_pattern`` (``ml.get_arr``), carried per slice; the graph always builds an "
    "iSWA cache (``build_attn_inp_kv_iswa``), so every range keeps a local layer; local/global head widths, "
    "RoPE dims and bases are read per layer through ``is_swa(il)``, ``rope_freqs`` (global layers) is a "
    "global tensor every slice carries; ``layer_output_scale`` and MoE routers/scales are per-layer tensors; "
    "the model type from the layer count (30/35/42/60) only names the model. KV sharing "
    "(``shared_kv_layers``): shared layers reuse layer kv_from-2/kv_from-1 (create_memory's reuse "
    "callback), so cuts stay at or before kv_from-2 and each slice states its own count; that callback "
    "asserts ``n_layer_kv_from_start >= 2``, so no range has 1 layer. Per-layer embeddings (E2B/E4B) "
    "are refused: each layer's extra input is computed from the token ids and layer 0's input"
)

# -- qwen3next: a hybrid of gated delta-net (recurrent) and attention layers ----------------

def _qwen3next_recurrent(meta: Meta, arch: str, n_layer: int) -> list[bool]:
    """qwen3next.cpp ``load_arch_hparams``: ``attention.recurrent_layers`` if the file has it, else layer
    il is recurrent unless ``(il + 1) % full_attention_interval == 0`` (default 4): of the absolute index."""
    flags = meta.get(f"{arch}.attention.recurrent_layers")
    if isinstance(flags, list):
        return [bool(x) for x in flags[:n_layer]]
    interval = _int(meta, f"{arch}.full_attention_interval") or 4
    return [(il + 1) % interval != 0 for il in range(n_layer)]


_NO_ATTN = ("a qwen3next slice without an attention layer leaves llama.cpp's hybrid memory an attention cache "
            "with no tensors, and the first decode aborts (GGML_ASSERT(buffer) in ggml_backend_buffer_get_type, "
            "from llama_kv_cache::set_input_k_idxs via llm_graph_input_mem_hybrid::set_input)")
_NO_RECR = ("a qwen3next slice without a gated delta-net layer leaves llama.cpp's hybrid memory a recurrent "
            "state with no tensors, and the first decode aborts (GGML_ASSERT(buffer), "
            "llm_graph_input_mem_hybrid::set_input)")


def _qwen3next_slice_reason(flags: list[bool], start: int, end: int) -> str | None:
    if all(flags[start:end]):
        return _NO_ATTN
    if not any(flags[start:end]):
        return _NO_RECR
    return None


def _qwen3next_boundaries(meta: Meta, arch: str, n_layer: int) -> dict[int, str]:
    flags = _qwen3next_recurrent(meta, arch, n_layer)
    out: dict[int, str] = {}
    for k in range(1, n_layer):
        why = _qwen3next_slice_reason(flags, 0, k) or _qwen3next_slice_reason(flags, k, n_layer)
        if why is not None:
            out[k] = why
    return out


def _qwen3next_range(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> str | None:
    return _qwen3next_slice_reason(_qwen3next_recurrent(meta, arch, n_layer), start, end)


def _qwen3next_kv(meta: Meta, arch: str, n_layer: int, start: int, end: int) -> dict[str, Any]:
    """Every slice states which of its layers are recurrent, as an explicit per-layer array."""
    return {f"{arch}.attention.recurrent_layers": _qwen3next_recurrent(meta, arch, n_layer)[start:end]}


#: what failover replay and rollback need from a hybrid's recurrent state (docs/models.md)
HYBRID_STATE = (
    "Each hop keeps its own layers' recurrent state (conv + delta-net state per sequence, "
    "llama-memory-recurrent.cpp) beside their KV cache, so a forward pass through a route is exact. "
    "Failover replay works: a fresh hop replays the history from position 0 and rebuilds that state. "
    "Rolling back a position does not: llama_memory_recurrent::seq_rm keeps one state per sequence and "
    "refuses to drop positions from the end (0 < p0, returns false) unless the context keeps snapshots "
    "(n_rs_seq, only for llm_arch_supports_rs_rollback archs, not this one), so resuming at a confirmed "
    "prefix shorter than what a hop computed, or dropping a rejected draft, needs llama.cpp's recurrent "
    "checkpoints or a replay from 0: the executor's truncate raises CacheMissError and clears the sequence "
    "(the initiator then replays)"
)

_QWEN3NEXT_NOTE = (
    "qwen3next.cpp: embeddings enter layer 0 unchanged (build_inp_embd, no scale); which layers are "
    "gated delta-net (recurrent) and which attend comes from attention.recurrent_layers or, in older files, "
    "(il + 1) % full_attention_interval: every slice states its part explicitly; routers, experts, shared "
    "experts and their gates are per-layer tensors; the MTP block (nextn_predict_layers) is not part of "
    "any range; the model type from the layer count (48) only names the model. Every slice must hold an "
    "attention layer and a delta-net layer: llama.cpp's hybrid memory aborts on a part with no tensors "
    "(GGML_ASSERT(buffer) at the first decode). " + HYBRID_STATE
)

ENTRIES: list[ArchPolicy] = [
    ArchPolicy(
        "gemma4", "models/gemma4.cpp, llama-model.cpp (create_memory), llama-hparams.cpp (has_kv)",
        input_scale=InputScale.TOKENS_SQRT_EMBD, swa=Swa(period=6, always=True), moe=True,
        boundary_rule=_gemma4_boundaries, range_rule=_gemma4_range, resolved_kv=_gemma4_kv,
        families="Gemma 4 31B, 26B-A4B (E2B/E4B: whole only, per-layer embeddings)",
        note=_GEMMA4_NOTE, test="tests/test_arch_newer.py"),
    ArchPolicy(
        "qwen3next", "models/qwen3next.cpp, models/delta-net-base.cpp, llama-memory-recurrent.cpp (seq_rm)",
        boundary_rule=_qwen3next_boundaries, range_rule=_qwen3next_range, resolved_kv=_qwen3next_kv, moe=True,
        recurrent=True,
        families="Qwen3-Next-80B-A3B (Instruct, Thinking)",
        note=_QWEN3NEXT_NOTE, test="tests/test_arch_newer.py"),
]

REFUSED: list[Refused] = []


# -- every other architecture the pinned build names (llama-arch.cpp LLM_ARCH_NAMES) -----------

def _refuse(names: str, reason: str, source: str, families: dict[str, str] | None = None) -> list[Refused]:
    fam = families or {}
    return [Refused(n, reason, source, fam.get(n, "")) for n in names.split()]


_ROLLBACK = ("llama_memory_recurrent::seq_rm refuses to drop positions from the end of a sequence (0 < p0) "
             "unless the context keeps n_rs_seq snapshots")
_SNAPSHOTS = "llm_arch_supports_rs_rollback (llama-arch.cpp)"

REFUSED += [
    *_refuse("gptj", "the pinned build names gptj but builds no model for it (llama_model_mapping throws "
             "'unsupported model architecture'): it does not run whole either", "llama-model.cpp (llama_model_mapping)",
             {"gptj": "GPT-J 6B"}),
    *_refuse("clip", "not a language model: a placeholder for llama-quantize (llama-arch.cpp: 'dummy, only used by "
             "llama-quantize'); vision encoders run through mtmd", "llama-arch.cpp"),
    *_refuse("bert modern-bert nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert gemma-embedding",
             "an encoder (embedding/reranking) model: non-causal attention over the whole input and no KV memory "
             "(create_memory returns nullptr), so there is no token-by-token decode for a route to split",
             "llama-model.cpp (create_memory), models/<arch>.cpp",
             {"bert": "BERT, all-MiniLM, bge", "modern-bert": "ModernBERT", "nomic-bert": "nomic-embed-text v1/v1.5",
              "nomic-bert-moe": "nomic-embed-text v2 MoE", "jina-bert-v2": "jina-embeddings-v2",
              "jina-bert-v3": "jina-embeddings-v3", "gemma-embedding": "EmbeddingGemma 300M",
              "eurobert": "EuroBERT", "neo-bert": "NeoBERT"}),
    *_refuse("llama-embed", "an embedding model on llama's graph without a cache (graph<true>: "
             "llm_graph_input_attn_no_cache, non-causal): no autoregressive decode to split",
             "models/llama-embed.cpp, models/llama.cpp"),
    *_refuse("t5encoder", "encoder only (llama_encode): no autoregressive decode to split", "models/t5encoder.cpp",
             {"t5encoder": "T5 / Flan-T5 encoders (image-model text encoders)"}),
    *_refuse("t5", "an encoder-decoder: every decoder layer cross-attends to the encoder's output (llama_encode), "
             "an input a decoder-only route has no place for", "models/t5.cpp", {"t5": "T5, Flan-T5"}),
    *_refuse("dream llada llada-moe rnd1", "a diffusion language model (llm_arch_is_diffusion): it denoises the "
             "whole sequence with non-causal attention and no KV memory (create_memory returns nullptr); there is "
             "no autoregressive decode to split", "llama-arch.cpp, llama-model.cpp (create_memory)",
             {"dream": "Dream 7B", "llada": "LLaDA 8B", "llada-moe": "LLaDA-MoE", "rnd1": "RND1"}),
    *_refuse("wavtokenizer-dec", "not a text decoder: an audio codec decoder (codes to spectral features, posnet + "
             "convnext stacks, no KV memory)", "models/wavtokenizer-dec.cpp",
             {"wavtokenizer-dec": "WavTokenizer (OuteTTS)"}),
    *_refuse("pockettts", "not a text decoder: the backbone of a flow TTS pipeline, 'no lm_head, the audio latents "
             "are produced by the flow net inside the mmproj'", "models/pockettts.cpp"),
    *_refuse("mamba mamba2 rwkv6 rwkv6qwen2 rwkv7 arwkv7",
             "recurrent (llm_arch_is_recurrent): every layer keeps a state instead of a KV cache; graph not yet read "
             "for cuts at the pinned build. A hop would keep its layers' state (failover replay from position 0 "
             f"works), but {_ROLLBACK}, which these archs do not get ({_SNAPSHOTS}): rolling back a position would "
             "need a full replay, as for qwen3next",
             "llama-arch.cpp, llama-memory-recurrent.cpp (seq_rm)",
             {"mamba": "Mamba", "mamba2": "Mamba-2, Codestral Mamba", "rwkv6": "RWKV-6 Finch",
              "rwkv6qwen2": "QRWKV6", "rwkv7": "RWKV-7 Goose", "arwkv7": "ARWKV-7"}),
    *_refuse("jamba falcon-h1 plamo2 granitehybrid kimi-linear minimax-01",
             "hybrid (llm_arch_is_hybrid): some layers keep a recurrent state beside the attention KV; graph not yet "
             "read for cuts at the pinned build. As qwen3next shows, a cut can be exact for a forward pass (each hop "
             f"keeps its layers' state) and failover replay works, but {_ROLLBACK}, which these archs do not get "
             f"({_SNAPSHOTS}): rollback needs a full replay",
             "llama-arch.cpp, llama-memory-hybrid.cpp, llama-memory-recurrent.cpp (seq_rm)",
             {"jamba": "Jamba 1.5/1.6/1.7", "falcon-h1": "Falcon-H1", "plamo2": "PLaMo 2",
              "granitehybrid": "Granite 4.0 H (Tiny, Small, Micro)", "kimi-linear": "Kimi-Linear 48B-A3B",
              "minimax-01": "MiniMax-Text-01"}),
    *_refuse("lfm2 lfm2moe nemotron_h nemotron_h_moe bailingmoe3 kimi-k3 glm5-next",
             "hybrid (llm_arch_is_hybrid): some layers keep a recurrent state beside the attention KV; graph not yet "
             "read for cuts at the pinned build. A forward cut keeps each hop's state and failover replay works; "
             f"rollback is one of the archs this build snapshots ({_SNAPSHOTS}: n_rs_seq, bounded, experimental), "
             "which meshnode's executor does not yet request",
             "llama-arch.cpp, llama-memory-recurrent.cpp (seq_rm), llama-context.cpp (n_rs_seq)",
             {"lfm2": "LFM2 350M-2.6B", "lfm2moe": "LFM2-8B-A1B", "nemotron_h": "Nemotron-H, NVIDIA Nemotron Nano 2",
              "nemotron_h_moe": "Nemotron-H MoE", "bailingmoe3": "Ling-3.0 tiny/flash", "kimi-k3": "Kimi-K3",
              "glm5-next": "GLM-5.3-Flash"}),
    *_refuse("deepseek4", "hybrid (llm_arch_is_hybrid) with compressed sparse attention (an indexer over a "
             "compressed state cache, llama-kv-cache-dsv4.cpp) and always-windowed layers; graph not yet read for "
             "cuts at the pinned build", "models/deepseek4.cpp, llama-kv-cache-dsv4.cpp",
             {"deepseek4": "DeepSeek-V4-Flash"}),
    *_refuse("qwen3vl qwen3vlmoe",
             "an embeddings batch must be n_embd x (1 + n_deepstack_layers) wide (llama_hparams::n_embd_inp: the "
             "deepstack features added to the first layers' outputs, qwen3vl.cpp), while a hop passes the n_embd "
             "residual; graph not yet read for cuts at the pinned build",
             "models/qwen3vl.cpp, llama-hparams.cpp (n_embd_inp), llama-context.cpp (decode)",
             {"qwen3vl": "Qwen3-VL 2B-32B", "qwen3vlmoe": "Qwen3-VL-30B-A3B, 235B-A22B"}),
    *_refuse("qwen35 qwen35moe qwen4exp",
             "hybrid (gated delta-net + attention, llm_arch_is_hybrid) with interleaved M-RoPE; graph not yet read "
             "for cuts at the pinned build. A forward cut keeps each hop's state and failover replay works; its "
             f"recurrent rollback is one this build snapshots ({_SNAPSHOTS}: n_rs_seq, bounded, experimental), "
             "which meshnode's executor does not yet request",
             "models/qwen35.cpp, llama-arch.cpp, llama-memory-recurrent.cpp (seq_rm)",
             {"qwen35": "Qwen3.5 (e.g. 9B)", "qwen35moe": "Qwen3.5 MoE (e.g. 35B-A3B)",
              "qwen4exp": "Qwen3.8-Flash-Next"}),
    *_refuse("gemma3n", "per-layer inputs computed from the token ids (per_layer_tok_embd) and from layer 0's input "
             "(per_layer_model_proj), which no hop fed embeddings receives (a hop after the first sees neither); "
             "also AltUp streams and KV sharing from layer 20 fixed in code (n_layer_kv_from_start = 20)",
             "models/gemma3n.cpp", {"gemma3n": "Gemma 3n E2B/E4B"}),
    *_refuse("gemma4-assistant eagle3 dflash", "a draft model: its graph reads another context (cparams.ctx_other: the "
             "target's KV cache or hidden states), not a previous hop's residual",
             "models/<arch>.cpp, llama-model.cpp (create_memory: share), llama-context.cpp",
             {"gemma4-assistant": "Gemma 4 MTP assistants", "eagle3": "EAGLE-3 drafts",
              "dflash": "DFlash / DSpark drafts"}),
    *_refuse("deepseek32 glm-dsa dots3note hy_v4 minimax-m3",
             "sparse attention: an indexer scores past tokens and each layer attends to the top-k, its keys in a "
             "cache of their own (llama_kv_cache_dsa / _msa / hybrid_idx); graph not yet read for cuts at the "
             "pinned build", "llama-model.cpp (create_memory), models/<arch>.cpp",
             {"deepseek32": "DeepSeek-V3.2(-Exp)", "glm-dsa": "GLM-5.2", "hy_v4": "Hy4-preview"}),
    *_refuse("cogvlm", "picks its text or image weights per batch by input kind (cogvlm.cpp: ubatch.token ? text : "
             "image): every hop is fed embeddings, so it would run the image expert", "models/cogvlm.cpp",
             {"cogvlm": "CogVLM, CogAgent"}),
    *_refuse("graniteswitch", "adapter routing from the token ids (llm_graph_input_switch::set_input reads "
             "ubatch->token, and sets nothing for an embeddings batch): hops fed embeddings lose it",
             "models/granite-switch.cpp"),
    *_refuse("hrm_text nanbeige", "the graph runs its stored blocks several times (HRM's low/high stacks cycled; "
             "nanbeige's loops share physical weights and the logical layer count is expanded at load), so a "
             "computed layer is not one block of the file; not read further for cuts",
             "models/hrm-text.cpp, models/nanbeige.cpp", {"hrm_text": "HRM-Text (Mimir)", "nanbeige": "Nanbeige"}),
    *_refuse("granite_swa", "windowed Granite with deepstack inputs (Granite 4 Vision: deepstack_mapping, embeddings "
             "inputs carry extra channels); graph not yet read for cuts at the pinned build", "models/granite-swa.cpp"),
]

_UNREAD = ("a decoder whose graph was not yet read for cuts at the pinned build (what it does with the layer index, "
           "the layer count and embeddings input is unchecked); it runs whole")
REFUSED += _refuse(
    "deci falcon grok gpt2 gptneox mpt baichuan starcoder refact bloom stablelm qwen phi2 phimoe plamo plamo3 "
    "codeshell orion internlm2 minicpm minicpm3 gemma starcoder2 maple xverse cohere2moe dbrx olmo olmoe "
    "muse-glimmer openelm arctic deepseek deepseek2-ocr chatglm bitnet jais jais2 nemotron exaone exaone4 exaone-moe "
    "chameleon plm bailingmoe bailingmoe2 dots1 arcee afmoe laguna ernie4_5 ernie4_5-moe hunyuan-moe hunyuan-dense "
    "hy_v3 smollm3 smallthinker seed_oss grovemoe apertus minimax-m2 pangu-embedded mistral4 mimo2 step35 spark2_5 "
    "maincoder talkie mellum qwen2vl paddleocr qwen3tts glm4 hunyuan_vl",
    _UNREAD, "models/<arch>.cpp",
    {"deci": "Llama-3.1-Nemotron (Deci)", "falcon": "Falcon 7B/40B/180B", "grok": "Grok-1, Grok-2", "gpt2": "GPT-2",
     "gptneox": "Pythia, GPT-NeoX", "mpt": "MPT", "baichuan": "Baichuan 2", "starcoder": "StarCoder",
     "bloom": "BLOOM", "stablelm": "StableLM 2", "qwen": "Qwen (1)", "phi2": "Phi-2", "phimoe": "Phi-3.5-MoE",
     "internlm2": "InternLM2/2.5", "minicpm": "MiniCPM", "minicpm3": "MiniCPM3", "gemma": "Gemma 2B/7B",
     "starcoder2": "StarCoder2", "cohere2moe": "North-Mini-Code-1.0", "dbrx": "DBRX", "olmo": "OLMo",
     "olmoe": "OLMoE", "arctic": "Snowflake Arctic", "deepseek": "DeepSeek LLM/MoE 16B",
     "deepseek2-ocr": "DeepSeek-OCR", "chatglm": "ChatGLM3, GLM-4 (chatglm)", "bitnet": "BitNet b1.58",
     "jais": "Jais", "nemotron": "Nemotron-4, Minitron", "exaone": "EXAONE 3.5", "exaone4": "EXAONE 4.0",
     "exaone-moe": "K-EXAONE-236B-A23B", "chameleon": "Chameleon", "bailingmoe": "Ling-lite/plus",
     "bailingmoe2": "Ling-mini-2.0", "dots1": "dots.llm1", "arcee": "Arcee AFM-4.5B",
     "ernie4_5": "ERNIE 4.5 0.3B", "ernie4_5-moe": "ERNIE 4.5 21B-A3B/300B-A47B", "hunyuan-moe": "Hunyuan-A13B",
     "hunyuan-dense": "Hunyuan dense 0.5B-7B", "hy_v3": "Hy3", "smollm3": "SmolLM3 3B",
     "smallthinker": "SmallThinker", "seed_oss": "Seed-OSS 36B", "grovemoe": "GroveMoE", "apertus": "Apertus",
     "minimax-m2": "MiniMax-M2", "pangu-embedded": "openPangu-Embedded", "spark2_5": "Spark-X2.5-1.7B",
     "laguna": "Laguna XS.2, S-2.1 (poolside)", "maincoder": "Maincoder-1B", "afmoe": "Arcee Trinity",
     "qwen2vl": "Qwen2-VL, Qwen2.5-VL", "paddleocr": "PaddleOCR-VL", "qwen3tts": "Qwen3-TTS",
     "glm4": "GLM-4-9B-0414, GLM-4.1V, GLM-OCR", "hunyuan_vl": "HunyuanOCR"})
