"""Reading a GGUF's metadata, with typed errors for files that are not usable.

``inspect_model`` is the one gate every command passes a ``--model PATH``
through: a missing file, a file that is not a GGUF, or a GGUF whose tensor
data runs past the end of the file (truncated) each raise a distinct error
before llama.cpp ever sees the file (llama.cpp would abort or return NULL).
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
from meshnode.paths import cache_dir

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelInfo:
    """What meshnode needs to know of a model file."""

    path: Path
    #: general.architecture, e.g. "llama"
    arch: str
    #: {arch}.block_count of *this file* (a range file has its own count)
    n_layer: int
    #: {arch}.embedding_length: width of the residual stream
    n_embd: int
    #: number of vocabulary entries (0 for a range without vocabulary)
    n_vocab: int
    #: general.name, or the file name
    name: str
    #: size of the file in bytes
    size: int


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def open_reader(path: Path) -> gguf.GGUFReader:
    """Open a GGUF, translating every way it can be unusable into a typed error."""
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
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFormatError(f"{path} is not a GGUF file (magic {magic!r}, want {GGUF_MAGIC!r})")


def inspect_model(path: Path) -> ModelInfo:
    reader = open_reader(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFormatError(f"{path} has no general.architecture")
    n_layer = _field(reader, f"{arch}.block_count")
    n_embd = _field(reader, f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise ModelFormatError(f"{path} lacks {arch}.block_count / {arch}.embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else 0
    name = _field(reader, "general.name")
    return ModelInfo(
        path=path,
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        name=name if isinstance(name, str) else path.stem,
        size=path.stat().st_size,
    )


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint(path: Path) -> str:
    """sha256 of the model file, memoised by (path, size, mtime) in the cache dir."""
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
