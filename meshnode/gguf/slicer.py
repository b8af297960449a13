"""Cut a layer range [a, b) out of a GGUF without changing any tensor's bytes.

The artifact of a range lives in ``<cache>/ranges/<fingerprint>/<a>-<b>.s<SLICER_VERSION>/``
(a cut of another slicer version is another directory: never mistaken for
this one's, never overwritten by it):

* ``range.gguf``  the layers, renumbered ``blk.0 ..``, with
  ``{arch}.block_count = b - a`` and every per-layer array hyperparameter
  sliced. A non-tail range carries a one-entry stand-in vocabulary
  (``tokenizer.ggml.model = "none"``) and a 1-row ``token_embd``: llama.cpp's
  loader insists on both tensors but never reads them, and a one-entry
  vocabulary also shrinks the logits buffer llama.cpp allocates per output
  row. No ``output.weight``: a non-tail range never computes the lm_head
  (the residual is captured before it, see native/capture.c).
  A tail carries the full vocabulary, ``output_norm`` and one
  vocabulary-sized matrix, its lm_head, as ``token_embd``: the source's
  ``token_embd`` if the model is tied (no ``output.weight``), else the
  source's ``output.weight`` bytes and type under the name ``token_embd``,
  and no ``output.weight``. The tail's input is a residual, so llama.cpp never
  reads its token rows (``build_inp_embd`` selects the embeddings branch), and
  without ``output.weight`` its loader takes ``token_embd`` as the lm_head,
  placed as the output tensor would be: the same matrix through the same
  kernel, one vocabulary-sized matrix fewer to map (arch.py,
  ``output_falls_back_to_token_embd``; ``ties_output`` says when).
* ``vocab.gguf`` (head only) the source's metadata and its ``token_embd``
  tensor, unchanged: the head tokenizes with it (llama.cpp, vocab only) and
  looks token rows up in it itself, feeding embeddings to layer 0.
* ``manifest.json`` the source fingerprint (the model id: meshnode/modelid), the
  range, and the sha256 of every tensor in the slice (as named in
  ``range.gguf``), plus a range digest over them all; ``token_embd_is_output``
  says whether the tail's ``token_embd`` holds the source's ``output.weight``.
  Written last: a directory with a manifest is complete, so
  work already done is not redone.

The whole model [0, n_layer) is not copied: its artifact is the source file.
"""

from __future__ import annotations

import enum
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshnode.errors import ModelFormatError
from meshnode.gguf.arch import Output, check_cut, slice_kv
from meshnode.gguf.archtable import POLICIES
from meshnode.gguf.meta import GGUFMeta, TensorInfo, read_meta, tensor_data
from meshnode.gguf.model import ModelInfo, check_file, fingerprint, inspect_model
from meshnode.gguf.pages import settle
from meshnode.runtime.paths import cache_dir

#: how a cut reports its progress: (what it does, done, total)
Progress = Callable[[str, int, int], None]

MANIFEST_FORMAT = "meshnode-range/1"
#: bump when the slicer's output changes, so stale artifacts are rebuilt (it is part of the
#: artifact's directory name). 4: an untied model's tail carries output.weight as its token_embd
SLICER_VERSION = 4

#: output.* tensors llama.cpp still reads beside a token_embd that stands in for output.weight
#: (qwen2's optional output.bias); any other (NVFP4's output.scale / output.input_scale) needs a
#: real output tensor: llama_model::load_tensors asserts a tied NVFP4 output has no scales
_OUTPUT_KEPT_WHEN_TIED = frozenset({"output.weight", "output.bias"})
#: per-tensor activation precision, by tensor name (llama_prec_policy::load)
_TENSOR_PREC_KEY = "general.tensor_extra.name"


class Role(enum.StrEnum):
    HEAD = "head"  # takes token ids
    MIDDLE = "middle"  # residual in, residual out
    TAIL = "tail"  # residual in, logits out
    WHOLE = "whole"  # the whole model: tokens in, logits out


def role_of(start: int, end: int, n_layer: int) -> Role:
    if start == 0 and end == n_layer:
        return Role.WHOLE
    if start == 0:
        return Role.HEAD
    if end == n_layer:
        return Role.TAIL
    return Role.MIDDLE


@dataclass(frozen=True)
class RangeArtifact:
    """A range ready to load: its files and its manifest."""

    dir: Path
    #: the GGUF llama.cpp loads for this range
    range_path: Path
    #: the head's vocabulary + token table (None for other roles)
    vocab_path: Path | None
    manifest: dict[str, Any]

    @property
    def role(self) -> Role:
        return Role(self.manifest["role"])

    @property
    def start(self) -> int:
        return int(self.manifest["range"][0])

    @property
    def end(self) -> int:
        return int(self.manifest["range"][1])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["source"]["fingerprint"])

    @property
    def n_layer_total(self) -> int:
        return int(self.manifest["source"]["n_layer"])

    @property
    def range_digest(self) -> str:
        return str(self.manifest["range_digest"])


def tensor_sha256(t: Any) -> str:
    """sha256 of a gguf-py ReaderTensor's bytes (what ``tensor_table`` records for it)."""
    return hashlib.sha256(np.ascontiguousarray(t.data).view(np.uint8).data).hexdigest()


def range_digest(tensors: dict[str, dict[str, Any]]) -> str:
    """One digest over every tensor of a range: sha256 of sorted 'name type shape sha' lines."""
    lines = (
        f"{name} {info['type']} {'x'.join(map(str, info['shape']))} {info['sha256']}\n"
        for name, info in sorted(tensors.items())
    )
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def ties_output(src: GGUFMeta, arch: str) -> bool:
    """Whether a tail of ``src`` carries ``output.weight``'s bytes as its ``token_embd`` (and no ``output.weight``).

    Only for an untied model (it has ``output.weight``) of an architecture
    whose loader falls back to ``token_embd`` for the lm_head (arch.py,
    ``Output.OPTIONAL``), with ``output.weight`` of ``token_embd``'s shape; not
    when anything else refers to the output tensor: NVFP4 scale tensors
    (``output.scale``, ...) or a per-tensor precision table by name
    (``general.tensor_extra.name``).
    """
    policy = POLICIES.get(arch)
    if policy is None or policy.output is not Output.OPTIONAL:
        return False
    by_name = {t.name: t for t in src.tensors}
    out, emb = by_name.get("output.weight"), by_name.get("token_embd.weight")
    if out is None or emb is None or out.shape != emb.shape:
        return False
    if out.type == gguf.GGMLQuantizationType.NVFP4 or _TENSOR_PREC_KEY in src.fields:
        return False
    return not any(n.startswith("output.") and n not in _OUTPUT_KEPT_WHEN_TIED for n in by_name)


def _copy_kv(writer: gguf.GGUFWriter, src: GGUFMeta, skip: Iterable[str]) -> None:
    skipped = set(skip) | {"general.architecture"}
    for key, value in src.fields.items():
        if key in skipped:
            continue
        vtype, sub = src.types[key]
        writer.add_key_value(key, value, vtype, sub)


def _add_raw(writer: gguf.GGUFWriter, path: Path, name: str, t: TensorInfo) -> None:
    """Add tensor ``t`` of the file ``path`` under ``name`` with its bytes unchanged."""
    data = tensor_data(path, t)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t.type)


def _renamed(name: str, start: int, end: int) -> str | None:
    """blk.N.* -> blk.(N-start).* for N in [start, end); None for other layers."""
    if not name.startswith("blk."):
        return name
    idx_s, rest = name[4:].split(".", 1)
    idx = int(idx_s)
    if start <= idx < end:
        return f"blk.{idx - start}.{rest}"
    return None


def source_reads(src: GGUFMeta, start: int, end: int) -> set[str]:
    """The source tensors a cut of [start, end) reads (``_write_range`` and ``_write_vocab``): the blocks
    of the range, the global tensors, and of the two vocabulary-sized matrices what the role uses. A
    node that fetches a range from peers fetches exactly these (meshnode/fetch)."""
    arch = str(src.fields["general.architecture"])
    n_layer = int(src.fields[f"{arch}.block_count"]) - int(src.fields.get(f"{arch}.nextn_predict_layers", 0) or 0)
    role = role_of(start, end, n_layer)
    names = {t.name for t in src.tensors}
    out = {n for n in names if _renamed(n, start, end) is not None and n not in ("token_embd.weight", "output.weight")}
    if role in (Role.HEAD, Role.WHOLE):
        out.add("token_embd.weight")
    if role in (Role.TAIL, Role.WHOLE):
        tie = role is Role.TAIL and ties_output(src, arch)
        if not tie:
            out.add("token_embd.weight")
        if "output.weight" in names and (tie or POLICIES[arch].output is not Output.TIED):
            out.add("output.weight")
    return out & names


def _write_range(path: Path, src: GGUFMeta, arch: str, n_layer: int,
                 start: int, end: int, role: Role, out: Path, progress: Progress) -> bool:
    """Write the range file; True if its token_embd holds the source's output.weight (``ties_output``)."""
    meta = src.fields
    policy = POLICIES[arch]
    writer = gguf.GGUFWriter(out, arch)
    tiny_vocab = role in (Role.HEAD, Role.MIDDLE)
    tie = role is Role.TAIL and ties_output(src, arch)
    n_layer_all = int(meta[f"{arch}.block_count"])
    per_layer = {
        k for k, v in meta.items()
        if k.startswith(f"{arch}.") and isinstance(v, list) and len(v) == n_layer_all
    }
    put, drop = slice_kv(meta, arch, n_layer, start, end, head=role is Role.HEAD)
    per_layer -= set(put) | drop
    skip = {f"{arch}.block_count", *per_layer, *put, *drop}
    if tiny_vocab:
        skip |= {k for k in meta if k.startswith("tokenizer.")} | {f"{arch}.vocab_size"}
    _copy_kv(writer, src, skip)
    writer.add_uint32(f"{arch}.block_count", end - start)
    for key in sorted(per_layer):
        writer.add_key_value(key, meta[key][start:end], *src.types[key])
    for key, value in sorted(put.items()):
        _add_like(writer, src, key, value)
    if tiny_vocab:
        writer.add_string("tokenizer.ggml.model", "none")
        writer.add_uint32(f"{arch}.vocab_size", 1)
    n_embd = int(meta[f"{arch}.embedding_length"])
    output = next((t for t in src.tensors if t.name == "output.weight"), None)
    for t in src.tensors:
        name = _renamed(t.name, start, end)
        if name is None:
            continue
        if tiny_vocab and name == "token_embd.weight":
            writer.add_tensor(name, np.zeros((1, n_embd), dtype=np.float32))
        elif name == "output.weight" and (tie or policy.output is Output.TIED):
            continue  # the tail's token_embd is its lm_head (tie), or the loader never reads it (TIED)
        elif tiny_vocab and name == "output.weight":
            if policy.output is Output.REQUIRED:  # the loader insists on one; never computed here
                writer.add_tensor(name, np.zeros((1, n_embd), dtype=np.float32))
        elif tie and name == "token_embd.weight":
            assert output is not None
            _add_raw(writer, path, name, output)  # the lm_head, under the name llama.cpp falls back to
        else:
            _add_raw(writer, path, name, t)
    _finish(writer, progress, f"layers {start}:{end}")
    return tie


def _add_like(writer: gguf.GGUFWriter, src: GGUFMeta, key: str, value: Any) -> None:
    """Write ``key`` with the source's type if it has one, else a type inferred from the value."""
    if key in src.types and not isinstance(value, list):
        writer.add_key_value(key, value, *src.types[key])
    else:
        add_inferred(writer, key, value)


def add_inferred(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Write ``key`` typed by its value: bool, int as uint32, float as float32, str, or an array."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list | tuple):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write {key}={value!r}")


def _finish(writer: gguf.GGUFWriter, progress: Progress, what: str) -> None:
    """Write the header, metadata and tensors, reporting each tensor written."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    (fout,) = writer.fout
    writer.write_padding(fout, fout.tell())
    (tensors,) = writer.tensors
    for i, ti in enumerate(tensors.values()):  # as GGUFWriter.write_tensors_to_file, one report a tensor
        assert ti.tensor is not None
        ti.tensor.tofile(fout)
        writer.write_padding(fout, ti.nbytes)
        ti.tensor = None
        progress(f"writing {what}", i + 1, len(tensors))
    writer.close()


def _write_vocab(path: Path, src: GGUFMeta, arch: str, out: Path, progress: Progress) -> None:
    """The head's vocabulary: all metadata, zero layers, and token_embd unchanged."""
    writer = gguf.GGUFWriter(out, arch)
    _copy_kv(writer, src, {f"{arch}.block_count", f"{arch}.nextn_predict_layers"})
    writer.add_uint32(f"{arch}.block_count", 0)
    for t in src.tensors:
        if t.name == "token_embd.weight":
            _add_raw(writer, path, t.name, t)
    _finish(writer, progress, "the head's vocabulary")


def sha256_at(fh: Any, offset: int, n: int, buf: memoryview,
              truncated: Callable[[], Exception] | None = None) -> str:
    """sha256 of ``n`` bytes of ``fh`` from ``offset``, read through ``buf`` (one reused buffer).

    ``truncated()`` is raised if the file ends first (default: ModelFormatError)."""
    h = hashlib.sha256()
    fh.seek(offset)
    while n:
        got = fh.readinto(buf[: min(n, len(buf))])
        if not got:
            raise truncated() if truncated else ModelFormatError(f"{fh.name} ended inside a tensor")
        h.update(buf[:got])
        n -= got
    return h.hexdigest()


def tensor_table(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {type, shape, sha256, offset, n_bytes} for every tensor of a GGUF file.

    The sha256 is of the tensor's bytes in the file; the
    metadata is read with ``read_meta``, which skips the vocabulary arrays.
    """
    check_file(path)
    meta = read_meta(path)
    buf = memoryview(bytearray(1 << 20))
    with path.open("rb", buffering=0) as fh:
        return {
            t.name: {
                "type": t.type.name,
                "shape": list(t.shape),
                "sha256": sha256_at(fh, t.offset, t.n_bytes, buf),
                "offset": t.offset,
                "n_bytes": t.n_bytes,
            }
            for t in meta.tensors
        }


def artifact_dir(fp: str, start: int, end: int, root: Path | None = None) -> Path:
    """Where [start, end) of the source with fingerprint ``fp`` is cut, by this slicer version (under
    ``root`` instead of the cache, for a cut that is thrown away after use)."""
    return (root or cache_dir()) / "ranges" / fp[:32] / f"{start}-{end}.s{SLICER_VERSION}"


def _load(dir_: Path, source: Path) -> RangeArtifact | None:
    mpath = dir_ / "manifest.json"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("slicer") != SLICER_VERSION:
        return None
    role = Role(manifest["role"])
    range_path = source if role is Role.WHOLE else dir_ / "range.gguf"
    vocab = dir_ / "vocab.gguf" if role is Role.HEAD else None
    for f in (range_path, vocab):
        if f is not None and not f.exists():
            return None
    return RangeArtifact(dir_, range_path, vocab, manifest)


def cached_range(source: Path, start: int, end: int) -> RangeArtifact | None:
    """The artifact if it was cut already (cheap: no GGUF parsing), else None."""
    if not source.is_file():
        return None
    return _load(artifact_dir(fingerprint(source), start, end), source)


def whole_model(source: Path) -> RangeArtifact:
    """The whole model as a local, unattested artifact: the source file loaded as it is.

    For running the whole model in this process (``generate --model``): no
    manifest is written and no tensor is hashed, since nothing is attested to
    a peer; llama.cpp loads the very file ``Llama(source)`` would.
    """
    info = inspect_model(source)
    manifest = {
        "format": MANIFEST_FORMAT, "slicer": SLICER_VERSION, "range": [0, info.n_layer], "role": Role.WHOLE.value,
        "source": {"fingerprint": "", "name": info.name, "arch": info.arch, "n_layer": info.n_layer,
                   "n_embd": info.n_embd, "file": str(source.resolve())},
        "tensors": {}, "range_digest": "", "vocab_tensors": {}, "token_embd_is_output": False,
    }
    return RangeArtifact(source.parent, source, None, manifest)


def ensure_range(source: Path, start: int, end: int, progress: Progress | None = None, *,
                 root: Path | None = None) -> RangeArtifact:
    """The artifact of [start, end) of ``source``, cut now unless already cut.

    A cached artifact is found without parsing the source (its fingerprint is
    memoised by path, size and mtime, so a changed file is cut anew).
    ``progress(what, done, total)`` is told how the cut goes. ``root``: cut under this directory,
    not the cache (meshnode/audit/recompute.py: a range a stranger's evidence names is not kept).
    """
    check_file(source)
    done = cached_range(source, start, end)
    if done is not None:
        return done
    return _cut(source, start, end, progress or _quiet, root)


def _quiet(what: str, done: int, total: int) -> None:
    pass


def _cut(source: Path, start: int, end: int, progress: Progress, root: Path | None = None) -> RangeArtifact:
    progress("reading metadata", 0, 1)
    meta = read_meta(source, full=True)
    info = inspect_model(source)
    check_cut(meta.fields, info.arch, info.n_layer, start, end)
    if start != 0 or end != info.n_layer:  # a whole model is not copied
        from meshnode.cache import check_room

        reads = source_reads(meta, start, end)
        check_room(sum(t.n_bytes for t in meta.tensors if t.name in reads), f"cutting layers {start}:{end}", root)
    progress("fingerprinting the source", 0, 1)
    fp = fingerprint(source)
    dir_ = artifact_dir(fp, start, end, root)
    role = role_of(start, end, info.n_layer)
    dir_.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dir_.name}.", dir=dir_.parent))
    try:
        files: dict[str, Path] = {}
        tied = False
        if role is not Role.WHOLE:
            tied = _write_range(source, meta, info.arch, info.n_layer, start, end, role, tmp / "range.gguf",
                                progress)
            files["range.gguf"] = tmp / "range.gguf"
        if role is Role.HEAD:
            _write_vocab(source, meta, info.arch, tmp / "vocab.gguf", progress)
            files["vocab.gguf"] = tmp / "vocab.gguf"
        for f in files.values():  # read back from disk: large folios, faster steps (gguf/pages.py)
            settle(f)
        progress("hashing tensors", 0, 1)
        manifest = _manifest(source, info, fp, start, end, role, files, tied)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if dir_.exists():
            shutil.rmtree(dir_)
        tmp.rename(dir_)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    loaded = _load(dir_, source)
    assert loaded is not None
    return loaded


def _manifest(source: Path, info: ModelInfo, fp: str, start: int, end: int, role: Role,
              files: dict[str, Path], tied: bool) -> dict[str, Any]:
    tensors = tensor_table(files.get("range.gguf", source))
    return {
        "format": MANIFEST_FORMAT,
        "slicer": SLICER_VERSION,
        "source": {
            "fingerprint": fp,
            "name": info.name,
            "arch": info.arch,
            "n_layer": info.n_layer,
            "n_embd": info.n_embd,
            "file": str(source.resolve()),
        },
        "range": [start, end],
        "role": role.value,
        "tensors": tensors,
        "range_digest": range_digest(tensors),
        "vocab_tensors": tensor_table(files["vocab.gguf"]) if "vocab.gguf" in files else {},
        # the tail's token_embd.weight is the source's output.weight (its bytes and type)
        "token_embd_is_output": tied,
    }
