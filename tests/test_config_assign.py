"""The config file and range assignment: pure functions."""

from __future__ import annotations

import pytest

from meshnode.config import load, resolve
from meshnode.errors import InputError
from meshnode.routing.assign import weakest_range


def test_toml_config_and_precedence(tmp_path):
    p = tmp_path / "node.toml"
    p.write_text('layers = "0:15"\nlisten = "127.0.0.1:7001"\nheartbeat = 5\nmax_sessions = 2\n')
    doc = load(p)
    assert doc["heartbeat"] == 5.0
    got = resolve({"listen": "127.0.0.1:9"}, doc)
    assert got["listen"] == "127.0.0.1:9"  # the flag wins
    assert got["layers"] == "0:15"  # the file fills in
    assert got["drain_timeout"] == 30.0  # the default stays


@pytest.mark.parametrize("text", ['lyers = "0:1"\n', 'heartbeat = "soon"\n', "layers = [\n"])
def test_bad_config_is_refused(tmp_path, text):
    p = tmp_path / "node.toml"
    p.write_text(text)
    with pytest.raises(InputError):
        load(p)


def test_weakest_range_fills_gaps_then_thin_spots():
    assert weakest_range([1] * 15 + [2] * 15, 15) == (0, 15)
    assert weakest_range([2] * 15 + [1] * 15, 15) == (15, 30)
    assert weakest_range([1] * 10 + [0] * 5 + [1] * 15, 10) == (5, 15)  # the gap first
    assert weakest_range([1] * 30, 10) == (0, 10)  # ties: the lowest start
    with pytest.raises(InputError):
        weakest_range([1] * 4, 5)
