"""A small GGUF metadata reader: the header, key/values and tensor infos, nothing more.

gguf-py's ``GGUFReader`` builds a numpy view for every element of every
array value; SmolLM2's two vocabulary arrays (49,152 tokens, 48,900 merges)
alone make it spend ~3.5 s and tens of MB on metadata a start-up never
looks at. This reader walks the same layout (GGUF v2/v3, little-endian,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with
``struct.unpack_from`` over an mmap, and steps over long arrays: it keeps
their element type and count (``ArrayInfo``) but not their values. Short
arrays (per-layer hyperparameters) and every scalar are decoded.

Tensor data is never read; ``TensorInfo`` gives each tensor's absolute
offset and byte length, so callers can hash or map it themselves.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from meshnode.errors import ModelFormatError

#: arrays longer than this are stepped over (vocabularies); per-layer arrays are far shorter
MAX_DECODED = 4096
#: GGUF's default data alignment when ``general.alignment`` is absent (gguf.md, "File Structure")
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.md, "gguf_metadata_value_type") -> struct format of one element
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayInfo:
    """An array value that was stepped over: its element type and length."""

    item_type: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    #: dimensions in ggml order (ne0 first), as gguf-py's ReaderTensor.shape
    shape: tuple[int, ...]
    #: the ggml type, e.g. Q4_1
    type: GGMLQuantizationType
    #: absolute offset of the tensor's bytes in the file
    offset: int
    #: length of the tensor's bytes
    n_bytes: int


@dataclass(frozen=True)
class GGUFMeta:
    version: int
    #: key -> value: scalars, strings, lists for short arrays, ArrayInfo for long ones (all lists if ``full``)
    fields: dict[str, Any]
    tensors: list[TensorInfo]
    #: key -> (value type, element type for an array else None), as GGUFWriter.add_key_value takes them
    types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    #: where the tensor data starts: everything before it is the header (key/values, tensor infos, padding)
    data_offset: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf: mmap.mmap, full: bool) -> None:
        self.buf, self.pos, self.full = buf, 0, full
        #: the element type of the last array read (for ``GGUFMeta.types``)
        self.last_item: int | None = None

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return raw.decode("utf-8")

    def skip_string(self) -> None:
        self.pos += self.take("Q")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise ValueError(f"unknown value type {vtype}")

    def array(self) -> Any:
        item, count = self.take("I"), self.take("Q")
        self.last_item = item
        if item == _ARRAY:
            raise ValueError("nested arrays are not supported")
        if count > MAX_DECODED and not self.full:
            self._skip_items(item, count)
            return ArrayInfo(item, count)
        if item in _SCALAR:
            fmt = f"<{count}{_SCALAR[item]}"
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        return [self.value(item) for _ in range(count)]

    def _skip_items(self, item: int, count: int) -> None:
        if item in _SCALAR:
            self.pos += count * struct.calcsize("<" + _SCALAR[item])
        elif item == _STRING:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self.buf, self.pos
            for _ in range(count):  # each string is a u64 length, then its bytes
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        else:
            raise ValueError(f"arrays of type {item} are not supported")


def _tensor(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string()
    n_dims = cur.take("I")
    if not 0 < n_dims <= 4:
        raise ValueError(f"tensor {name} has {n_dims} dimensions")
    dims = tuple(cur.take("Q") for _ in range(n_dims))
    return name, dims, GGMLQuantizationType(cur.take("I")), cur.take("Q")


def _parse(buf: mmap.mmap, full: bool) -> GGUFMeta:
    cur = _Cursor(buf, full)
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (a big-endian file?) is not supported")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    fields: dict[str, Any] = {}
    types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.take("I")
        fields[key] = cur.value(vtype)
        sub = GGUFValueType(cur.last_item) if vtype == _ARRAY and cur.last_item is not None else None
        types[key] = (GGUFValueType(vtype), sub)
    raw = [_tensor(cur) for _ in range(n_tensors)]
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    data = -(-cur.pos // align) * align
    tensors = []
    for name, dims, qtype, rel in raw:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elem = 1
        for d in dims:
            n_elem *= d
        tensors.append(TensorInfo(name, dims, qtype, data + rel, n_elem * type_size // block))
    return GGUFMeta(version, fields, tensors, types, data)


def read_meta(path: Path, *, full: bool = False) -> GGUFMeta:
    """The metadata of the GGUF at ``path``; ModelFormatError if it cannot be parsed or is truncated.

    ``full``: decode long arrays too (the vocabulary, ~0.1 s for SmolLM2), for
    copying them into a cut. The caller checks that the file exists and carries
    the magic first (``model.check_file``), so that those get their own errors.
    """
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            size = len(buf)
            meta = _parse(buf, full)
    except (ValueError, struct.error, UnicodeDecodeError, KeyError, OSError) as e:
        raise ModelFormatError(f"{path} is a damaged GGUF: {e}") from e
    for t in meta.tensors:
        if t.offset + t.n_bytes > size:
            raise ModelFormatError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.offset + t.n_bytes} but the file has {size}"
            )
    return meta


#: ggml types whose tensors gguf-py exposes as arrays of their own element type (others: bytes)
_PLAIN = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


def tensor_data(path: Path, t: TensorInfo) -> npt.NDArray[Any]:
    """A read-only map of a tensor's bytes, shaped as gguf-py's ReaderTensor.data (for GGUFWriter.add_tensor)."""
    shape = tuple(reversed(t.shape))
    plain = _PLAIN.get(t.type)
    if plain is None:
        return np.memmap(path, dtype=np.uint8, mode="r", offset=t.offset,
                         shape=quant_shape_to_byte_shape(shape, t.type))
    return np.memmap(path, dtype=plain, mode="r", offset=t.offset, shape=shape)
