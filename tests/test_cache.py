"""The model cache (meshnode/cache): ``model ls`` / ``rm`` / ``gc`` and ``--cache-limit``, never removing
what a running node serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from meshnode.cache.evict import Entry, choose, over
from meshnode.cache.inuse import in_use
from meshnode.gguf.model import fingerprint
from meshnode.runtime.launch import start_node


def _e(kind: str, name: str, size: int, used: float, served: bool = False) -> Entry:
    return Entry(kind, name, size, used, served)


def test_the_limit_removes_unserved_ranges_least_recently_used_first() -> None:
    es = [_e("range", "old", 10, 1.0), _e("range", "served", 10, 0.5, served=True), _e("range", "new", 10, 3.0),
          _e("fetched", "f", 10, 0.1), _e("file", "whole", 1000, 0.0)]
    assert over(es, 25) == 15  # files do not count: they are the user's
    assert [e.path for e in choose(es, 25)] == ["old", "new"]
    assert [e.path for e in choose(es, 0)] == ["old", "new", "f"]  # never the served one, never a file
    assert choose(es, 100) == []


def _cli(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshnode", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MESHNODE_CACHE_DIR": str(cache)})


def _ls(cache: Path) -> list[dict]:
    done = _cli(cache, "model", "ls", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_ls_rm_gc_and_the_limit_never_touch_what_a_node_serves(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for layers in ("0:10", "10:20", "20:30"):
        assert _cli(cache, "model", "slice", "--model", str(model), "--layers", layers).returncode == 0
    ranges = {e["layers"]: e for e in _ls(cache) if e["kind"] == "range"}
    assert set(ranges) == {"0:10", "10:20", "20:30"}
    mid = fingerprint(model)
    assert all(e["model_id"] == mid and e["bytes"] > 0 and not e["served"] for e in ranges.values())
    node = start_node(model, "0:10", env={"MESHNODE_CACHE_DIR": str(cache)})
    try:
        served = {e["layers"]: e["served"] for e in _ls(cache) if e["kind"] == "range"}
        assert served == {"0:10": True, "10:20": False, "20:30": False}
        assert in_use(Path(ranges["0:10"]["path"]))
        refused = _cli(cache, "model", "rm", mid[:12])
        assert refused.returncode != 0
        assert "in use by a running node" in refused.stderr
        assert Path(ranges["10:20"]["path"]).exists()  # nothing removed when anything is refused
        gone = _cli(cache, "model", "rm", ranges["20:30"]["path"])
        assert gone.returncode == 0, gone.stderr
        assert not Path(ranges["20:30"]["path"]).exists()
        gc = _cli(cache, "model", "gc", "--limit", "0")
        assert gc.returncode == 0, gc.stderr
        assert not Path(ranges["10:20"]["path"]).exists()
        assert Path(ranges["0:10"]["path"]).exists()  # served: kept whatever the limit
        assert _cli(cache, "model", "rm", "zz").returncode != 0  # not an id prefix, not a path it holds
    finally:
        node.stop()
    assert not in_use(Path(ranges["0:10"]["path"]))  # the lock went with the process
    # a node with a cache limit removes unserved ranges when it starts, and keeps its own
    assert _cli(cache, "model", "slice", "--model", str(model), "--layers", "20:30").returncode == 0
    node = start_node(model, "10:20", extra=("--cache-limit", "0"), env={"MESHNODE_CACHE_DIR": str(cache)},
                      log_json=True)  # INFO lines, as under systemd
    try:
        left = {e["layers"] for e in _ls(cache) if e["kind"] == "range"}
        assert left == {"10:20"}
        assert "cache limit: removed range" in node.stderr()
    finally:
        node.stop()
    assert _cli(cache, "model", "gc", "--limit", "-1").returncode != 0
