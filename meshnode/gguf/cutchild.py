"""A range cut in a child process (``meshnode model slice``): parsing a GGUF's metadata costs far
more memory than serving a range, and a node's RSS should be what it serves, not what it once parsed.
The child's progress lines go on to this process's stderr; its typed error comes back as itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from meshnode import errors
from meshnode.gguf.slicer import RangeArtifact, cached_range


def cut_in_child(model: Path, start: int, end: int) -> RangeArtifact:
    """Layers ``start:end`` of ``model``, cut now unless they are cut already. Blocking."""
    art = cached_range(model, start, end)
    if art is not None:
        return art
    cmd = [sys.executable, "-m", "meshnode", "model", "slice", "--model", str(model), "--layers", f"{start}:{end}"]
    returncode, stderr = _run_streaming(cmd)
    if returncode != 0:
        raise _child_error(stderr)
    art = cached_range(model, start, end)
    if art is None:
        raise errors.ModelError(f"cutting layers {start}:{end} left no artifact")
    return art


def _run_streaming(cmd: list[str]) -> tuple[int, str]:
    """Run the cutting child; its progress lines go on to our stderr as they come (a cut takes
    seconds), its error lines are kept for ``_child_error``. Blocking."""
    kept: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:
            kept.append(line)
            if line.startswith("meshnode: ") and not line.startswith("meshnode: error:"):
                sys.stderr.write(line)
                sys.stderr.flush()
    return proc.returncode, "".join(kept[-50:])


def _child_error(stderr: str) -> errors.MeshnodeError:
    """Rebuild the typed error a ``meshnode`` child printed as ``meshnode: error: CODE: msg``."""
    for line in reversed(stderr.splitlines()):
        m = re.match(r"meshnode: error: ([A-Z_]+): (.*)", line)
        if m:
            return errors.from_code(m.group(1), m.group(2))
    return errors.ModelError(f"cutting the range failed: {stderr.strip()[-400:]}")
