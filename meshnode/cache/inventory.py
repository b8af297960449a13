"""What the cache holds: whole model files, models fetched in part, and cut ranges (``model ls``).

Sizes are disk usage (a fetched model is a sparse file: only its fetched pieces take disk). A model
id is shown when it is known without reading the file (the ids kept in ``model-ids.json``); a range
is served when a running node holds it (cache/inuse.py), and a whole file when a served range was
cut from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshnode.cache.evict import Entry
from meshnode.cache.inuse import in_use, last_used
from meshnode.runtime.paths import cache_dir

#: cache sub-directories that hold whole model files
FILE_DIRS = ("models", "bench")


def disk_bytes(path: Path) -> int:
    """Blocks used on disk by a file, or by every file under a directory."""
    try:
        if path.is_file():
            return path.stat().st_blocks * 512
        return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    except OSError:
        return 0


def _known_ids(root: Path) -> dict[str, str]:
    """resolved path -> model id, for the files whose current version's id is kept."""
    try:
        table = json.loads((root / "model-ids.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for key, mid in table.items() if isinstance(table, dict) else ():
        path, _, rest = key.rpartition("|")
        path, _, size = path.rpartition("|")
        try:
            st = Path(path).stat()
        except OSError:
            continue
        if str(st.st_size) == size and str(st.st_mtime_ns) == rest:
            out[path] = str(mid)
    return out


def scan(root: Path | None = None) -> list[Entry]:
    root = root or cache_dir()
    ids = _known_ids(root)
    entries: list[Entry] = []
    served_sources: set[str] = set()
    for d in sorted((root / "ranges").glob("*/*")):
        if not d.is_dir() or d.name.startswith("."):
            continue
        try:
            m = json.loads((d / "manifest.json").read_text())
            src, (a, b) = m["source"], m["range"]
        except (OSError, ValueError, KeyError, TypeError):
            entries.append(Entry("range", str(d), disk_bytes(d), last_used(d), in_use(d), name="(incomplete cut)"))
            continue
        served = in_use(d)
        if served:
            served_sources.add(str(src.get("file", "")))
        entries.append(Entry("range", str(d), disk_bytes(d), last_used(d), served, str(src.get("fingerprint", "")),
                             str(src.get("name", "")), f"{a}:{b}"))
    for d in sorted((root / "fetched").glob("*")):
        if not d.is_dir():
            continue
        served = in_use(d)
        if served:
            served_sources.add(str(d / "model.gguf"))
        entries.append(Entry("fetched", str(d / "model.gguf"), disk_bytes(d), last_used(d), served, d.name,
                             _name(d / "model.gguf")))
    for sub in FILE_DIRS:
        for f in sorted((root / sub).glob("*.gguf")):
            r = str(f.resolve())
            entries.append(Entry("file", str(f), disk_bytes(f), f.stat().st_mtime, r in served_sources or
                                 str(f) in served_sources, ids.get(r, ""), f.name))
    return entries


def _name(path: Path) -> str:
    try:
        from meshnode.gguf.meta import read_meta

        name = read_meta(path).get("general.name")
        return name if isinstance(name, str) else path.name
    except Exception:  # a fetch that has not got its header yet
        return "(no header yet)"


def remove(entry: Entry) -> None:
    """Delete an entry's files (a range's or fetched model's directory, or the file)."""
    p = Path(entry.path)
    target = p.parent if entry.kind == "fetched" else p
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
