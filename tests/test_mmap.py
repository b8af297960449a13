"""Where a range's weights live (docs/performance.md, "Weights mapped or read").

A node reads its range's weights into its own memory while they take at most half the memory available,
so that decode speed does not ride on the page cache's state of the file, and maps the file when memory
is tighter (executor/weights.py); ``--mmap`` / ``--no-mmap`` (``mmap = true|false`` in the config file)
decide it by hand. Either way the same bits come out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnode import config, errors
from meshnode.executor.config import ExecConfig
from meshnode.executor.weights import READ_SHARE, reads_weights, resolve_mmap
from meshnode.gguf.slicer import ensure_range


def _mapped(path: Path) -> bool:
    target = str(path.resolve())
    with open("/proc/self/maps") as fh:
        return any(line.rstrip("\n").endswith(target) for line in fh)


def test_a_range_read_or_mapped_computes_the_same_bits_and_a_read_one_maps_nothing_of_its_file(model: Path) -> None:
    from meshnode.executor._llama import LlamaRange

    head, tail = ensure_range(model, 0, 15), ensure_range(model, 15, 30)
    assert not _mapped(head.range_path)
    outs = []
    for use_mmap in (False, True):
        cfg = ExecConfig(n_threads=1, n_threads_batch=1, max_sessions=1, use_mmap=use_mmap)
        h, t = LlamaRange(head, cfg), LlamaRange(tail, cfg)
        try:
            assert _mapped(head.range_path) is use_mmap
            assert _mapped(tail.range_path) is use_mmap
            toks, pos, got = np.array([504, 3575, 282, 4649, 314], dtype=np.int32), 0, []
            for _ in range(6):
                residual = h.forward(0, pos, tokens=toks).residual
                logits = t.forward(0, pos, embd=residual).logits
                assert residual is not None
                assert logits is not None
                got.append((residual.copy(), logits.copy()))
                pos += len(toks)
                toks = np.array([int(np.argmax(logits))], dtype=np.int32)
            outs.append(got)
        finally:
            h.close()
            t.close()
        assert not _mapped(head.range_path)  # closed: nothing of the file stays mapped
    for (ra, la), (rb, lb) in zip(outs[0], outs[1], strict=True):
        assert np.array_equal(ra, rb)
        assert np.array_equal(la, lb)


def test_weights_are_read_while_they_take_at_most_half_the_memory_available(model: Path) -> None:
    gb = 1 << 30
    assert READ_SHARE == 2
    assert reads_weights(gb, 24 * gb)
    assert reads_weights(gb, 2 * gb)
    assert not reads_weights(gb + 1, 2 * gb)  # a node in a tight cgroup maps: the page cache can give way
    assert reads_weights(gb, 0)  # memory unknown: read
    art = ensure_range(model, 0, 15)
    size = art.range_path.stat().st_size
    assert resolve_mmap(ExecConfig(), art.range_path, 2 * size).use_mmap is False
    assert resolve_mmap(ExecConfig(), art.range_path, 2 * size - 1).use_mmap is True
    for given in (True, False):  # the user's word stands
        assert resolve_mmap(ExecConfig(use_mmap=given), art.range_path, 1).use_mmap is given
        assert resolve_mmap(ExecConfig(use_mmap=given), art.range_path, 100 * size).use_mmap is given


def test_the_mmap_flags_and_config_key_reach_the_executor(tmp_path: Path) -> None:
    from meshnode.cli.flags import exec_config
    from meshnode.cli.main import _node_settings, build_parser

    assert ExecConfig().use_mmap is None
    base = ["serve", "--model", "m.gguf", "--layers", "0:15"]
    assert exec_config(build_parser().parse_args(base)).use_mmap is None
    assert exec_config(build_parser().parse_args([*base, "--mmap"])).use_mmap is True
    assert exec_config(build_parser().parse_args([*base, "--no-mmap"])).use_mmap is False
    conf = tmp_path / "node.toml"
    for text, want in (("mmap = true\n", True), ("mmap = false\n", False), ("", None)):
        conf.write_text(text)
        ns = _node_settings(build_parser().parse_args([*base, "--config", str(conf)]))
        assert exec_config(ns).use_mmap is want
    conf.write_text("mmap = true\n")  # the flag wins over the file
    ns = _node_settings(build_parser().parse_args([*base, "--no-mmap", "--config", str(conf)]))
    assert exec_config(ns).use_mmap is False
    conf.write_text('mmap = "yes"\n')
    with pytest.raises(errors.InputError, match="mmap must be bool"):
        config.load(conf)
