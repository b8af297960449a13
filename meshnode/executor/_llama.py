"""Layer 2: owning wrappers over llama.cpp with typed errors.

``LlamaRange`` owns one model, one context (several KV sequences, one per
session) and its batches, and frees them through an ``ExitStack``. Every
input is validated *before* it reaches llama.cpp, whose own failure mode for
bad input is often a GGML_ASSERT that aborts the process.

Not thread-safe: the executor API (api.py) serialises calls per instance.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import numpy as np
import numpy.typing as npt

from meshnode.chat import ChatFormat
from meshnode.errors import (
    CacheMissError,
    CapacityError,
    ExecutorError,
    InputError,
    ModelFormatError,
    ShapeError,
)
from meshnode.executor import _bindings
from meshnode.executor.config import ExecConfig
from meshnode.executor.context import mem_available, resolve_ctx
from meshnode.executor.linger import Linger
from meshnode.executor.weights import resolve_mmap
from meshnode.gguf.arch import InputScale
from meshnode.gguf.archtable import POLICIES
from meshnode.gguf.meta import read_meta
from meshnode.gguf.rows import dequantize_rows
from meshnode.gguf.slicer import RangeArtifact, Role

F32 = npt.NDArray[np.float32]


#: gemma2.cpp: ``inpL = ggml_scale(ctx0, inpL, sqrtf(n_embd)); cb(inpL, "inp_scaled", -1);``
INPUT_SCALED = "inp_scaled"


def _n_expert(path: Path) -> int:
    """``{arch}.expert_count`` of a GGUF (0: dense)."""
    meta = read_meta(path)
    n = meta.get(f"{meta.get('general.architecture')}.expert_count", 0)
    return int(n) if isinstance(n, int) else 0


def _load_model(path: Path, *, vocab_only: bool = False, use_mmap: bool = True) -> llama_cpp.llama_model_p:
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.vocab_only = vocab_only
    # off: the weights are read into this process's memory (ExecConfig.use_mmap)
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelFormatError(f"llama.cpp could not load {path}")
    return model  # type: ignore[no-any-return]


def batchable(lengths: list[int], n_ubatch: int) -> bool:
    """Whether chunks of these lengths keep their row order in one llama_decode.

    With non-unified KV, llama.cpp splits a batch "equally": it takes the same
    number of tokens from every sequence per micro-batch. Equal lengths that
    fit one micro-batch keep each chunk's rows together, in sequence order.
    """
    return len(set(lengths)) <= 1 and sum(lengths) <= n_ubatch


def _addr(ptr: Any) -> int:
    return int(ctypes.cast(ptr, ctypes.c_void_p).value or 0)


class Vocab:
    """Tokenizer of a model file (llama.cpp, vocab only)."""

    def __init__(self, path: Path, stack: contextlib.ExitStack) -> None:
        model = _load_model(path, vocab_only=True)
        stack.callback(llama_cpp.llama_model_free, model)
        self._model = model
        self._chat: ChatFormat | None = None
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_tokens = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        #: the BOS token id, -1 (LLAMA_TOKEN_NULL) if the vocabulary has none
        self.bos = int(llama_cpp.llama_vocab_bos(self._vocab))

    def meta(self, key: str) -> str | None:
        """A metadata value of the file as llama.cpp renders it to text (None: no such key)."""
        size = 1024
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def chat_format(self) -> ChatFormat:
        """How ``Llama.create_chat_completion`` would render chat for this file (meshnode/chat.py); read once."""
        if self._chat is None:
            def text(tok: int) -> str:
                return llama_cpp.llama_vocab_get_text(self._vocab, tok).decode("utf-8") if tok != -1 else ""

            self._chat = ChatFormat(self.meta("tokenizer.chat_template"),
                                    bos_token=text(llama_cpp.llama_vocab_bos(self._vocab)),
                                    eos_token=text(llama_cpp.llama_vocab_eos(self._vocab)))
        return self._chat

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """As llama.cpp does by default: BOS if the vocab wants it, specials parsed."""
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise InputError("prompt could not be tokenized")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        return buf.raw[: max(n, 0)]

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))


class TokenTable:
    """The head's own token-embedding lookup, from vocab.gguf's token_embd (mmap).

    Rows are dequantized as ggml's get_rows does (meshnode/gguf/rows.py: numpy
    for Q8_0 and the float types, the gguf package otherwise; bit-identical,
    tested), and it lets the head's range file carry no vocabulary-sized
    tensor at all.
    """

    def __init__(self, path: Path, info: dict[str, Any], scale: float | None) -> None:
        # mapped straight from the manifest's offsets: parsing the file's
        # metadata with GGUFReader would cost tens of MB of RSS in every head
        self.n_vocab = int(info["shape"][1])
        row_bytes = int(info["n_bytes"]) // self.n_vocab
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=int(info["offset"]),
                               shape=(self.n_vocab, row_bytes))
        self._qtype = gguf.GGMLQuantizationType[info["type"]]
        self._scale = None if scale is None else np.float32(scale)

    def lookup(self, tokens: npt.NDArray[np.int32]) -> F32:
        rows = self._data[tokens]
        out = dequantize_rows(rows, self._qtype)
        if self._scale is not None:
            out = out * self._scale  # float32 x float32, as ggml_scale
        return np.ascontiguousarray(out, dtype=np.float32)


@dataclass(frozen=True)
class Chunk:
    """One session's rows for one llama_decode: token ids (head/whole) or residual rows."""

    seq: int
    pos0: int
    tokens: npt.NDArray[np.int32] | None = None
    embd: F32 | None = None


@dataclass
class StepOutput:
    #: [n_tokens, n_embd] residual after this range (non-tail), else None
    residual: F32 | None
    #: [n_vocab] logits of the last token (tail/whole), else None
    logits: F32 | None


class LlamaRange:
    """One loaded range: model + context + batches, freed by ``close()``."""

    def __init__(self, artifact: RangeArtifact, config: ExecConfig) -> None:
        _bindings.backend_init()
        self.artifact = artifact
        # the settings left to the file and the machine: the session context, then where the weights live
        self.config = resolve_mmap(resolve_ctx(config, artifact.range_path), artifact.range_path, mem_available())
        self.role = artifact.role
        self._stack = contextlib.ExitStack()
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise

    # -- construction -----------------------------------------------------

    def _open(self) -> None:
        a = self.artifact
        self._model = _load_model(a.range_path, use_mmap=bool(self.config.use_mmap))
        self._stack.callback(llama_cpp.llama_model_free, self._model)
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        if self.n_layer != a.end - a.start:
            raise ModelFormatError(f"{a.range_path} has {self.n_layer} layers, manifest says {a.end - a.start}")
        self.captures = self.role in (Role.HEAD, Role.MIDDLE)
        self.takes_tokens = self.role in (Role.HEAD, Role.WHOLE)
        policy = POLICIES.get(a.manifest["source"]["arch"])
        #: the graph scales any input it gets (gemma2): a hop fed a residual puts it back after the scale
        self.restores_input = (policy is not None and policy.input_scale is InputScale.ALL_SQRT_EMBD
                               and self.role in (Role.MIDDLE, Role.TAIL))
        self.vocab: Vocab | None = None
        self.table: TokenTable | None = None
        if self.role is Role.HEAD:
            # no llama.cpp vocabulary here (~10 MB of RSS): the tail tokenizes
            assert a.vocab_path is not None
            scale = math.sqrt(self.n_embd) if policy and policy.head_scales_by_sqrt_embd else None
            self.table = TokenTable(a.vocab_path, a.manifest["vocab_tensors"]["token_embd.weight"], scale)
        elif self.role in (Role.TAIL, Role.WHOLE):
            self.vocab = Vocab(a.range_path, self._stack)
        self.n_vocab_out = self.vocab.n_tokens if self.vocab and not self.captures else 0
        #: several sessions' steps in one llama_decode give each what it gets alone: not with experts, where
        #: ggml's mul_mat_id over several rows accumulates differently than over one (measured on the tiny
        #: qwen3moe, deepseek2 and glm4moe: logits differ), so a MoE range runs one session per decode
        self.batches_exactly = not _n_expert(a.range_path)
        self._context()
        self._batch_tok = self._batch(embd=0)
        self._batch_emb = self._batch(embd=self.n_embd)
        self._mrope_pos = self._mrope_positions()
        self._next_pos = [0] * self.config.max_sessions

    def _context(self) -> None:
        c = self.config
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = c.n_ctx_per_session * c.max_sessions
        p.n_batch = c.n_batch
        p.n_ubatch = c.n_ubatch
        p.n_seq_max = c.max_sessions
        p.n_threads = c.n_threads
        p.n_threads_batch = c.n_threads_batch
        p.kv_unified = False  # each session's KV exact and independent
        p.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if c.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        p.embeddings = False
        p.no_perf = True
        if self.captures or self.restores_input:
            self._capture = _bindings.new_capture_state(
                f"l_out-{self.n_layer - 1}" if self.captures else "",
                INPUT_SCALED if self.restores_input else "")
            p.cb_eval = _bindings.capture_callback()
            p.cb_eval_user_data = ctypes.cast(ctypes.pointer(self._capture), ctypes.c_void_p)
        self._ctx = llama_cpp.llama_init_from_model(self._model, p)
        if not self._ctx:
            raise ExecutorError("llama.cpp could not create a context (out of memory?)")
        self._stack.callback(llama_cpp.llama_free, self._ctx)
        #: a ggml thread pool of this context's own (a llama.cpp built without OpenMP): its threads
        #: sleep as soon as a graph is done, so a hop that waits leaves its cores to the hop that computes
        most = max(c.n_threads, c.n_threads_batch, c.n_threads_solo)
        #: no OpenMP team here: the context's threads sleep (a pool of its own) or end after every graph
        self.threads_rest = not _bindings.openmp()
        self.own_pool = self.threads_rest and most > 1
        if self.own_pool:
            pool = _bindings.attach_threadpool(self._ctx, most, c.poll)
            self._stack.callback(_bindings.free_threadpool, self._ctx, pool)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        #: keeps this range's CPU awake between steps, for a while (executor/linger.py)
        self.linger = Linger(c.linger)
        self._stack.callback(self.linger.close)
        #: threads of a batch of single-token steps; the executor sets it before each batch (api.py)
        self.decode_threads = c.n_threads
        self._threads = (c.n_threads, c.n_threads_batch)  # what llama.cpp was last told
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        if self.n_ctx_seq != c.n_ctx_per_session:  # llama.cpp rounds: advertise what it holds
            self.config = dataclasses.replace(c, n_ctx_per_session=self.n_ctx_seq)

    def _batch(self, *, embd: int) -> llama_cpp.llama_batch:
        batch = llama_cpp.llama_batch_init(self.config.n_batch, embd, 1)
        self._stack.callback(llama_cpp.llama_batch_free, batch)
        return batch  # type: ignore[no-any-return]

    def _mrope_positions(self) -> npt.NDArray[np.int32] | None:
        """The embeddings batch's positions for an M-RoPE graph, else None.

        llama.cpp reads ``n_pos_per_embd()`` (4 for MROPE/IMROPE, llama-hparams.cpp) positions
        per embeddings row, section-major (llama-batch.cpp: ``pos[j * n_tokens + i]``), where a
        token row has one; ``forward_many`` writes ``[p, p, p, 0]``, what llama-graph.cpp
        (``llm_graph_input_pos::set_input``) makes of a token's position ``p``. The batch's own
        array (one per row) is swapped for one four times as long, and put back before it is freed.
        """
        rope = llama_cpp.llama_model_rope_type(self._model)
        if rope not in (llama_cpp.LLAMA_ROPE_TYPE_MROPE, llama_cpp.LLAMA_ROPE_TYPE_IMROPE):
            return None
        pos = np.zeros(4 * self.config.n_batch, dtype=np.int32)
        batch, ptype = self._batch_emb, ctypes.POINTER(llama_cpp.llama_pos)
        own = ctypes.cast(batch.pos, ptype)  # a copy of the pointer (the field itself is a view)
        batch.pos = pos.ctypes.data_as(ptype)  # type: ignore[assignment]  # (the binding's annotation is off)
        self._stack.callback(setattr, batch, "pos", own)  # runs before llama_batch_free (LIFO)
        return pos

    def close(self) -> None:
        self._stack.close()

    # -- execution ----------------------------------------------------------

    def next_pos(self, seq: int) -> int:
        return self._next_pos[seq]

    def release(self, seq: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        self._next_pos[seq] = 0

    def truncate(self, seq: int, n_past: int) -> None:
        """Keep only positions [0, n_past) of a sequence (a resumed session's confirmed prefix)."""
        if n_past < self._next_pos[seq]:
            if not llama_cpp.llama_memory_seq_rm(self._mem, seq, n_past, -1):
                # a recurrent state (hybrid archs: qwen3next, ...) holds one state per sequence and
                # cannot drop positions from the end (llama_memory_recurrent::seq_rm returns false):
                # drop the whole sequence, which it can, so that a replay from position 0 rebuilds it
                held = self._next_pos[seq]
                llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
                self._next_pos[seq] = 0
                raise CacheMissError(
                    f"this hop's layers keep a recurrent state that llama.cpp cannot roll back from position "
                    f"{held} to {n_past}; the session was cleared and must be replayed from position 0")
            self._next_pos[seq] = n_past

    def _check(self, seq: int, pos0: int, n: int) -> None:
        if not 0 <= seq < self.config.max_sessions:
            raise CapacityError(f"sequence {seq} is outside this executor's {self.config.max_sessions} slots")
        if n < 1 or n > self.config.n_batch:
            raise ShapeError(f"a step carries {n} tokens; allowed 1..{self.config.n_batch}")
        if pos0 != self._next_pos[seq]:
            raise CacheMissError(
                f"step starts at position {pos0} but this hop's KV cache holds positions "
                f"0..{self._next_pos[seq] - 1}"
            )
        if pos0 + n > self.n_ctx_seq:
            raise InputError(f"positions up to {pos0 + n} exceed this node's session context of {self.n_ctx_seq} "
                             "tokens: start it with a larger --ctx-size, or shorten the prompt")

    def forward(self, seq: int, pos0: int, *, tokens: npt.NDArray[np.int32] | None = None,
                embd: F32 | None = None) -> StepOutput:
        """Run this range on one chunk of one session. Blocking."""
        out = self.forward_many([Chunk(seq, pos0, tokens, embd)])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def forward_many(self, chunks: list[Chunk]) -> list[StepOutput | Exception]:
        """Run several sessions' chunks in one ``llama_decode`` (one weight pass). Blocking.

        Each chunk is validated on its own: a bad one gets its error and the
        rest still run. The chunks must be for distinct sequences; rows go
        into the batch in ascending sequence order, which is the order
        llama.cpp's equal split (non-unified KV) lays them out in its
        micro-batches, so the captured residual rows map back by offset.
        """
        results: list[StepOutput | Exception] = [ExecutorError("not run")] * len(chunks)
        ready: list[tuple[int, int, int, npt.NDArray[np.int32] | None, F32]] = []
        for i, c in enumerate(chunks):
            try:
                ready.append((c.seq, i, *self._prepare(c)))
            except Exception as e:  # typed errors from validation, per chunk
                results[i] = e
        if len({r[0] for r in ready}) != len(ready):
            raise ExecutorError("one batch may hold one chunk per sequence")
        ready.sort()
        rows = sum(r[2] for r in ready)
        if not ready:
            return results
        if len(ready) > 1 and not batchable([r[2] for r in ready], self.config.n_ubatch):
            raise ExecutorError("chunks batched together must be of equal length within one micro-batch")
        batch: Any = self._batch_tok if self.takes_tokens and self.table is None else self._batch_emb
        batch.n_tokens = rows
        row = 0
        for seq, _, n, toks, emb in ready:
            pos0 = self._next_pos[seq]
            for j in range(n):
                k = row + j
                batch.pos[k] = pos0 + j
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = seq
                batch.logits[k] = 1 if (self.captures or j == n - 1) else 0
            if toks is not None:
                ctypes.memmove(_addr(batch.token) + 4 * row, toks.ctypes.data, 4 * n)
            else:
                ctypes.memmove(_addr(batch.embd) + 4 * row * self.n_embd, emb.ctypes.data,
                               emb.nbytes)
            row += n
        if self._mrope_pos is not None and batch is self._batch_emb:
            pos = self._mrope_pos  # batch.pos: rows [0, rows) are written above
            pos[rows : 3 * rows] = np.tile(pos[:rows], 2)
            pos[3 * rows : 4 * rows] = 0
        try:
            outs = self._decode(batch, [(seq, n) for seq, _, n, _, _ in ready])
        except Exception as e:  # the whole batch failed: every chunk in it
            for _, i, _, _, _ in ready:
                results[i] = e
            return results
        for (_, i, _, _, _), out in zip(ready, outs, strict=True):
            results[i] = out
        return results

    def _prepare(self, c: Chunk) -> tuple[int, npt.NDArray[np.int32] | None, F32]:
        """Validate one chunk; returns (n_tokens, token ids or None, residual rows)."""
        tokens, embd = c.tokens, c.embd
        if self.role is Role.HEAD and tokens is not None:
            assert self.table is not None
            self._check_tokens(tokens)
            embd, tokens = self.table.lookup(tokens), None
        n = len(tokens) if tokens is not None else (0 if embd is None else embd.shape[0])
        self._check(c.seq, c.pos0, n)
        if tokens is not None:
            if not self.takes_tokens:
                raise ShapeError("this range takes a residual, not token ids")
            self._check_tokens(tokens)
            return n, np.ascontiguousarray(tokens, dtype=np.int32), np.empty((0, self.n_embd), np.float32)
        if embd is None or (self.takes_tokens and self.table is None):
            raise ShapeError("this range takes token ids, not a residual")
        if embd.shape != (n, self.n_embd) or embd.dtype != np.float32:
            raise ShapeError(f"residual has shape {embd.shape} {embd.dtype}; want ({n}, {self.n_embd}) float32")
        return n, None, np.ascontiguousarray(embd)

    def _check_tokens(self, tokens: npt.NDArray[np.int32]) -> None:
        limit = self.table.n_vocab if self.table else (self.vocab.n_tokens if self.vocab else 0)
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= limit):
            raise ShapeError(f"token ids must lie in [0, {limit})")

    def _decode(self, batch: llama_cpp.llama_batch, parts: list[tuple[int, int]]) -> list[StepOutput]:
        """One llama_decode over ``parts`` = [(seq, n_tokens)] laid out in order."""
        rows = sum(n for _, n in parts)
        out: F32 | None = None
        if self.captures:
            out = np.empty((rows, self.n_embd), dtype=np.float32)
            cap = self._capture
            cap.dst, cap.capacity = out.ctypes.data, out.nbytes
            cap.written = cap.hits = cap.overflow = 0
        if self.restores_input:  # the batch's embd rows, laid out in the order ubatches take them
            cap = self._capture
            cap.src, cap.src_size = _addr(batch.embd), 4 * rows * self.n_embd
            cap.src_read = cap.restores = cap.overflow = 0
        # llama.cpp uses n_threads_batch for any multi-token batch; a batch of sessions' decode
        # steps (one token each) is decode work: give it the decode threads (threads do not change
        # numerics). Prefill threads on every core would spin against the other hops' processes.
        # (llama.cpp itself takes n_threads for a one-token batch, n_threads_batch for more)
        decode = self.decode_threads
        threads = (decode, decode if all(n == 1 for _, n in parts) else self.config.n_threads_batch)
        if threads != self._threads:
            llama_cpp.llama_set_n_threads(self._ctx, *threads)
            self._threads = threads
        self.linger.busy()
        try:
            rc = llama_cpp.llama_decode(self._ctx, batch)
        finally:
            self.linger.idle()
        if rc != 0:
            # positions may be half-written: drop what this step added
            for seq, _ in parts:
                llama_cpp.llama_memory_seq_rm(self._mem, seq, self._next_pos[seq], -1)
            if rc == 1:
                raise CapacityError("llama.cpp found no free KV slot for this step")
            raise ExecutorError(f"llama_decode failed with code {rc}")
        if self.restores_input and (self._capture.overflow or self._capture.src_read != 4 * rows * self.n_embd):
            for seq, _ in parts:
                llama_cpp.llama_memory_seq_rm(self._mem, seq, self._next_pos[seq], -1)
            raise ExecutorError(f"input restore put back {self._capture.src_read} of {4 * rows * self.n_embd} bytes "
                                f"({self._capture.restores} restores)")
        for seq, n in parts:
            self._next_pos[seq] += n
        results: list[StepOutput] = []
        if out is not None:
            if self._capture.overflow or self._capture.written != out.nbytes:
                raise ExecutorError(
                    f"residual capture got {self._capture.written} of {out.nbytes} bytes "
                    f"({self._capture.hits} captures)"
                )
            row = 0
            for _, n in parts:
                results.append(StepOutput(residual=out[row : row + n], logits=None))
                row += n
            return results
        row = 0
        for _, n in parts:
            row += n
            ptr = llama_cpp.llama_get_logits_ith(self._ctx, row - 1)
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab_out,)).copy()
            results.append(StepOutput(residual=None, logits=logits))
        return results
