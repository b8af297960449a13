"""Reading a GGUF's metadata, with typed errors for files that are not usable.

``inspect_model`` is the one gate every command passes a ``--model PATH``
through: a missing file, a file that is not a GGUF, or a GGUF whose tensor
data runs past the end of the file (truncated) each raise a distinct error
before llama.cpp ever sees the file (llama.cpp would abort or return NULL).
It reads the metadata with ``meta.read_meta``, which steps over the
vocabulary arrays instead of parsing them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from meshnode.errors import ModelFormatError, ModelNotFoundError
from meshnode.gguf.meta import GGUFMeta, read_meta
from meshnode.runtime.paths import cache_dir

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    """What meshnode needs to know of a model file."""

    path: Path
    #: general.architecture, e.g. "llama"
    arch: str
    #: the layers of *this file* a route covers (a range file has its own count):
    #: {arch}.block_count less {arch}.nextn_predict_layers
    n_layer: int
    #: {arch}.embedding_length: width of the residual stream
    n_embd: int
    #: number of vocabulary entries (0 for a range without vocabulary)
    n_vocab: int
    #: general.name, or the file name
    name: str
    #: size of the file in bytes
    size: int
    #: {arch}.context_length: the context the model was trained for (0 if the file does not say)
    n_ctx_train: int = 0
    #: per layer: K plus V values one token adds to the KV cache (n_embd_k_gqa + n_embd_v_gqa)
    kv_widths: tuple[int, ...] = ()


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def open_reader(path: Path) -> gguf.GGUFReader:
    """Open a GGUF with gguf-py (slow: every vocabulary entry becomes a numpy view), for cutting it.

    Every way the file can be unusable becomes a typed error.
    """
    check_file(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct.error
        raise ModelFormatError(f"{path} is a damaged GGUF: {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelFormatError(
                f"{path} is truncated: tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {size}"
            )
    return reader


def check_file(path: Path) -> None:
    """Cheap checks: the file exists and starts with the GGUF magic."""
    if not path.exists():
        raise ModelNotFoundError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelNotFoundError(f"model path {path} is not a file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ModelNotFoundError(f"model file {path} cannot be read: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{path} is not a GGUF file (magic {magic!r}, want {GGUF_MAGIC!r})")


def _per_layer(value: Any, n_layer: int) -> list[int]:
    """A hyperparameter given once or per layer (a list), as one value per layer."""
    if isinstance(value, list):
        return [int(v) for v in value[:n_layer]]
    return [int(value)] * n_layer


def kv_widths(meta: GGUFMeta, arch: str, n_layer: int, n_embd: int) -> tuple[int, ...]:
    """Per layer, n_embd_k_gqa + n_embd_v_gqa: K and V values a token adds to the cache.

    As llama.cpp's hparams: n_head_kv * key_length (key_length defaults to n_embd / n_head).
    """
    heads = _per_layer(meta.get(f"{arch}.attention.head_count", 0), n_layer)
    kv = _per_layer(meta.get(f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count", 0)),
                    n_layer)
    out = []
    for h, h_kv in zip(heads, kv, strict=True):
        k = int(meta.get(f"{arch}.attention.key_length", n_embd // h if h else 0))
        v = int(meta.get(f"{arch}.attention.value_length", n_embd // h if h else 0))
        out.append(h_kv * (k + v))
    return tuple(out)


def inspect_model(path: Path) -> ModelInfo:
    """The model's metadata, read without touching its vocabulary or tensor data (~10 ms)."""
    check_file(path)
    meta = read_meta(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path} has no general.architecture")
    n_layer = meta.get(f"{arch}.block_count")
    n_embd = meta.get(f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise ModelFormatError(f"{path} lacks {arch}.block_count / {arch}.embedding_length")
    nextn = meta.get(f"{arch}.nextn_predict_layers", 0)
    if not isinstance(nextn, int) or not 0 <= nextn < n_layer:
        raise ModelFormatError(f"{path} has {arch}.nextn_predict_layers={nextn!r} for {n_layer} blocks")
    n_layer -= nextn  # the trunk: next-token-prediction blocks are not part of any route
    tokens = meta.get("tokenizer.ggml.tokens")
    name = meta.get("general.name")
    ctx = meta.get(f"{arch}.context_length")
    try:
        widths = kv_widths(meta, arch, n_layer, n_embd)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{path} has unusable attention hyperparameters: {e}") from e
    return ModelInfo(
        path=path,
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=len(tokens) if tokens is not None else 0,
        name=name if isinstance(name, str) else path.stem,
        size=path.stat().st_size,
        n_ctx_train=ctx if isinstance(ctx, int) else 0,
        kv_widths=widths,
    )


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint(path: Path) -> str:
    """The model's id: the sha256 of its manifest (meshnode/modelid), which every attestation,
    capability, directory record and ``--mesh`` name binds to. Computed once per file version."""
    from meshnode.modelid.local import model_id

    return model_id(path)


def file_sha256(path: Path) -> str:
    """sha256 of the whole file (what a download is checked against), memoised by (path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_dir() / "fingerprints.json"
    table: dict[str, str] = {}
    try:
        table = json.loads(memo.read_text())
    except (OSError, ValueError):
        table = {}
    if key in table:
        return table[key]
    digest = sha256_file(path)
    table[key] = digest
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(memo)
    return digest
