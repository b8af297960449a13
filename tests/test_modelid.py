"""Model ids (meshnode/modelid): the sha256 of a manifest that checks any piece of the model on its own."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from meshnode.errors import IntegrityError, ManifestError
from meshnode.gguf.model import fingerprint
from meshnode.modelid import manifest_of, parse
from meshnode.modelid.local import compute
from meshnode.modelid.manifest import MAX_MANIFEST_BYTES, check_piece, is_id_prefix
from tests.conftest import cli

SMALL_PIECE = 1 << 16


@pytest.fixture(scope="module")
def small(model: Path):
    """The default model's manifest with 64 KiB pieces (many tensors of several pieces)."""
    return compute(model, SMALL_PIECE)


def test_the_id_is_the_sha256_of_the_canonical_manifest_and_names_the_model(model: Path, small) -> None:
    m = manifest_of(model)
    assert m.model_id == hashlib.sha256(m.canonical()).hexdigest()
    assert fingerprint(model) == m.model_id  # what attestations, capabilities and --mesh bind to
    assert parse(m.canonical(), m.model_id) == m
    assert {t.name for t in m.tensors} >= {"token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"}
    assert m.tensor_bytes + m.header_bytes <= m.size
    assert small.model_id != m.model_id  # the piece size is part of what is named
    assert [t.sha256 for t in small.tensors] == [t.sha256 for t in m.tensors]


def test_every_piece_of_the_file_checks_against_the_manifest_alone(model: Path, small) -> None:
    data = model.read_bytes()
    check_piece(small.header_sha256, data[: small.header_bytes], "header")
    multi = [t for t in small.tensors if t.pieces]
    assert multi  # the embeddings and the large matrices span several pieces
    for t in small.tensors:
        spans = list(t.piece_spans(small.piece_bytes))
        assert sum(n for _, n, _ in spans) == t.n_bytes
        for off, n, digest in spans:
            check_piece(digest, data[off : off + n], f"{t.name} at {off}")
    t = multi[0]
    off, n, digest = next(t.piece_spans(small.piece_bytes))
    bad = bytearray(data[off : off + n])
    bad[n // 2] ^= 1
    with pytest.raises(IntegrityError, match=t.name):
        check_piece(digest, bytes(bad), t.name)


def test_one_changed_byte_anywhere_is_another_model(model: Path, tmp_path: Path) -> None:
    base = manifest_of(model).model_id
    t = manifest_of(model).tensor("blk.3.ffn_down.weight")
    for where in (t.offset + 7, 40):  # a tensor byte, a header byte (inside the key/values)
        copy = tmp_path / f"m{where}.gguf"
        shutil.copy(model, copy)
        with copy.open("r+b") as fh:
            fh.seek(where)
            b = fh.read(1)
            fh.seek(where)
            fh.write(bytes([b[0] ^ 0x10]))
        try:
            other = compute(copy)
        except ManifestError:
            continue  # a header byte that breaks the GGUF is refused, which is fine too
        assert other.model_id != base


def _doc(m) -> dict:
    return json.loads(m.canonical())


@pytest.mark.parametrize("mangle", [
    lambda d: d.update(format="other/1"),
    lambda d: d.update(size=-1),
    lambda d: d.update(piece_bytes=3 << 16),
    lambda d: d["header"].update(sha256="XYZ"),
    lambda d: d["tensors"][1].update(offset=d["tensors"][0]["offset"]),  # overlaps the one before
    lambda d: d["tensors"][1].update(name=d["tensors"][0]["name"]),
    lambda d: d["tensors"][0].update(n_bytes=1 << 60),
    lambda d: d["tensors"][0].update(pieces=["0" * 64]),  # fewer pieces than the tensor needs
    lambda d: d["tensors"][0].update(shape=[]),
    lambda d: d["tensors"][0].update(type=True),
    lambda d: d.update(tensors={"a": 1}),
])
def test_hostile_manifests_are_refused_with_a_typed_error(small, mangle) -> None:
    d = _doc(small)
    mangle(d)
    with pytest.raises(ManifestError):
        parse(json.dumps(d).encode())


def test_a_manifest_must_be_exactly_what_its_id_names(small) -> None:
    raw = small.canonical()
    with pytest.raises(ManifestError, match="do not hash"):
        parse(raw, "0" * 64)
    spaced = json.dumps(_doc(small), sort_keys=True).encode()  # same content, not canonical
    with pytest.raises(ManifestError, match="canonical"):
        parse(spaced, hashlib.sha256(spaced).hexdigest())
    for junk in (b"", b"\xff\xfe", b"[1,2]", b"{" * 100_000):
        with pytest.raises(ManifestError):
            parse(junk)
    with pytest.raises(ManifestError, match="over the limit"):
        parse(b" " * (MAX_MANIFEST_BYTES + 1))


def test_id_prefixes() -> None:
    assert is_id_prefix("40c894a7")
    assert not is_id_prefix("40c894a")  # too short
    assert not is_id_prefix("SmolLM2-135M")


def test_model_id_command(model: Path) -> None:
    done = cli("model", "id", str(model))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == manifest_of(model).model_id
    raw = cli("model", "id", str(model), "--manifest").stdout.encode().strip()
    assert hashlib.sha256(raw).hexdigest() == manifest_of(model).model_id
    bad = cli("model", "id", "/etc/hostname")
    assert bad.returncode != 0
    assert "not a GGUF" in bad.stderr
