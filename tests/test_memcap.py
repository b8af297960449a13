"""A model bigger than any one node (issue 24, item 5): three nodes of the 1.34 GB synthetic model, each
in a memory cgroup the test makes with a limit of 0.55 of the model, one of them joined with no copy
of the file; the route's greedy tokens equal the whole model's run without a limit. Also: ``join
--auto --memory`` takes as many layers as the budget holds, where the mesh is thinnest."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import synth
from bench.memcap import MemCap, Unavailable, drop_cached, memory_cgroup, model_files
from meshnode.errors import InputError
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import fingerprint, inspect_model
from meshnode.routing.sizing import (
    BASE,
    KV_SHARE,
    Weights,
    layer_bytes,
    need,
    peer_steps,
    relative_speed,
    sized_range,
    target_span,
)
from meshnode.runtime.launch import NodeProcess, start_node
from tests.conftest import cli, llama_reference
from tests.test_tracker import _start_tracker, _stop

CAP = 0.55
PROMPT = "The three primary colors are"
NODE_FLAGS = ("--max-sessions", "1", "--ctx-size", "512", "--heartbeat", "1")


def test_the_longest_window_that_fits_goes_where_the_mesh_is_thinnest() -> None:
    w = Weights((100,) * 10, 50, 60)
    mem = lambda weights: int((weights + BASE) / (1 - KV_SHARE)) + 1  # noqa: E731
    assert target_span([0] * 10) == 10
    assert target_span([1] * 5 + [0] * 5) == 5
    assert target_span([1] * 10) == 5
    assert sized_range([0] * 10, w, mem(2000)) == (0, 10)  # room for all: all
    assert sized_range([0] * 10, w, mem(450)) == (0, 4)  # 4 layers and the head's table
    assert sized_range([1] * 4 + [0] * 6, w, mem(700)) == (4, 10)  # the gap, with the tail
    assert sized_range([1] * 4 + [0] * 6, w, mem(300)) == (4, 7)
    # nodes of different memory joining one after another take layers in proportion to it, each where
    # the mesh is thinnest (a stretch nobody serves)
    cover = [0] * 10
    taken = []
    for weights in (600, 300, 160):
        a, b = sized_range(cover, w, mem(weights))
        assert min(cover[a:b]) == 0
        taken.append(b - a)
        cover = [c + (a <= i < b) for i, c in enumerate(cover)]
    assert taken == [6, 3, 1]
    with pytest.raises(InputError, match="not one layer fits"):
        sized_range([0] * 10, w, mem(20))


def test_where_every_layer_is_served_a_node_takes_layers_in_proportion_to_its_speed() -> None:
    mine = (0.001, 0.001)  # a step: 1 ms fixed, 1 ms a layer
    assert relative_speed(mine, [(10, 0.011), (5, 0.006)]) == 1.0
    assert relative_speed(mine, [(10, 0.0055), (10, 0.0056), (10, 0.011)]) == pytest.approx(0.5091, abs=1e-3)
    assert relative_speed(mine, [(10, 0.015)]) == 1.0  # within half: counted as equal (noise)
    assert relative_speed(mine, [(10, 0.011), (10, 0.033)]) == 1.0  # the lower median
    assert relative_speed(mine, [(10, 0.033)]) == pytest.approx(3.0)
    assert relative_speed((0.0, 0.0), [(10, 0.01)]) == 1.0  # unknown
    # a peer's range counts by the weight bytes a step computes: a tail's lm_head, not a head's table
    w10 = Weights((100,) * 10, 50, 60)
    assert peer_steps(w10, [(0, 5, 0.5), (5, 10, 0.7), (3, 12, 1.0)]) == [(560, 0.7)]  # heads only if alone
    assert peer_steps(w10, [(0, 5, 0.5)]) == [(500, 0.5)]
    w = Weights((100,) * 10, 50, 60)
    big = 10**9
    served = [1] * 10
    assert sized_range(served, w, big) == (0, 5)  # half the model, as fast as the others
    assert sized_range(served, w, big, speed=0.5) == (0, 2)  # half as fast: half of that (rounded)
    assert sized_range(served, w, big, speed=3.0) == (0, 10)  # faster: more, up to all of it
    gap = [1] * 5 + [0] * 5
    assert sized_range(gap, w, big, speed=0.2) == (5, 10)  # a gap is covered whatever the speed


def test_layer_bytes_count_blocks_and_the_vocabulary_matrices(model: Path) -> None:
    info = inspect_model(model)
    w = layer_bytes([(t.name, t.n_bytes) for t in read_meta(model).tensors], info.n_layer)
    assert len(w.per) == info.n_layer
    assert all(p > 0 for p in w.per)
    assert w.head == w.shared > 0  # SmolLM2 is tied: the tail's lm_head is the token table
    assert 0 < w.tail - w.head < 1 << 20  # (+ output_norm)
    assert need(w, 0, info.n_layer) <= model.stat().st_size < need(w, 0, info.n_layer) + (4 << 20)


FORCED_SLACK = 64 * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def big() -> Path:
    return synth.ensure_model(1.0)  # 1.34 GB, 24 layers (written once into the cache)


@pytest.fixture
def caps(big: Path) -> Iterator[list[MemCap]]:
    limit = int(CAP * big.stat().st_size)
    try:
        with memory_cgroup(limit) as a, memory_cgroup(limit) as b, memory_cgroup(limit) as c:
            yield [a, b, c]
    except Unavailable as e:
        pytest.skip(str(e))


def test_three_capped_nodes_one_with_no_copy_equal_the_whole_model(big: Path, caps: list[MemCap],
                                                                   tmp_path: Path) -> None:
    ref = llama_reference(big, PROMPT, 16, via_generate=False)
    proc, url = _start_tracker(tmp_path / "t.sqlite", ttl=10)
    nodes: list[NodeProcess] = []
    try:
        for cap, layers in zip(caps[:2], ("0:8", "8:16"), strict=True):
            drop_cached(model_files(big))  # the weights it maps are charged to its cgroup, not to an earlier reader
            nodes.append(start_node(big, layers, command="join", prefix=cap.prefix, timeout=300,
                                    extra=("--tracker", url, *NODE_FLAGS)))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # both listed before the third looks
            with urllib.request.urlopen(f"{url}/api/lookup?model={fingerprint(big)}", timeout=5) as r:
                if len([n for n in json.loads(r.read())["nodes"] if n.get("alive")]) == 2:
                    break
            time.sleep(0.3)
        nodes.append(start_node(None, "16:24", command="join", prefix=caps[2].prefix, timeout=600,
                                extra=("--mesh", fingerprint(big)[:16], "--tracker", url, *NODE_FLAGS),
                                env={"MESHNODE_CACHE_DIR": str(tmp_path / "empty-cache")}))
        assert "fetched" in nodes[2].stderr()
        done = cli("generate", *[a for n in nodes for a in ("--peer", n.endpoint)], "--prompt", PROMPT,
                   "--max-tokens", "16", "--temperature", "0", "--json")
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got["tokens"] == ref.tokens[: len(got["tokens"])]
        assert len(got["tokens"]) >= 8
        for n in nodes:
            assert n.proc.poll() is None  # none was killed by its limit
        for cap in caps:  # the kernel may force a charge a page or so past the limit (one that cannot fail,
            # e.g. for an exiting task); it never goes past one charge batch (64 pages) that way
            assert 0 < cap.peak() <= cap.limit + FORCED_SLACK
            assert cap.events().get("oom_kill", 0) == 0
        print(json.dumps({"limit_mb": caps[0].limit >> 20, "peak_mb": [c.peak() >> 20 for c in caps],
                          "events": [c.events() for c in caps]}), file=sys.stderr)
    finally:
        for n in nodes:
            n.stop()
        _stop(proc)
