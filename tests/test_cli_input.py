"""Names, flags and start-up failures: each refusal is one ``meshnode: error:`` line and an exit code.

No flag abbreviations; a HOST:PORT without a port is refused; a busy port, a
missing model, an unreadable or invalid config, a bad tracker URL all end
the process with one line, never a traceback. ``--mesh`` finds a model by its
file name, its general name, or a fingerprint prefix of 8+ hex digits.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from meshnode.gguf.model import fingerprint
from meshnode.routing.assign import file_names, is_short_prefix, model_matches
from tests.conftest import PROMPT, cli
from tests.test_tracker import _start_tracker, _stop

FP = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "Smollm2 135M 8k Lc100K Mix1 Ep2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def one_error_line(proc, code: int = 2) -> str:
    """The process failed with ``code`` and said so in exactly one line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("meshnode: error: ")
    assert "Traceback" not in proc.stderr
    return lines[0]


# -- --mesh names (pure) -------------------------------------------------------------


@pytest.mark.parametrize("query", [
    FILE, "SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct", "smollm2-135m-instruct",
    f"/root/.cache/meshnode/models/{FILE}", NAME, NAME.upper(), FP, FP[:8], FP[:8].upper(), f"  {FP[:12]} ",
])
def test_a_model_is_found_by_file_name_general_name_or_fingerprint_prefix(query):
    assert model_matches(FP, NAME, query, FILE)


@pytest.mark.parametrize("query", ["", "SmolLM2", "SmolLM2-135M", FP[:7], "b179c952x", FP[1:9], "Q4_1", ".gguf"])
def test_other_names_do_not_match(query):
    assert not model_matches(FP, NAME, query, FILE)


def test_file_names_and_short_prefixes():
    assert file_names("Llama-3.2-1B-Instruct-Q8_0.gguf") == {
        "llama-3.2-1b-instruct-q8_0.gguf", "llama-3.2-1b-instruct-q8_0", "llama-3.2-1b-instruct"}
    assert is_short_prefix("b179c95")
    assert not is_short_prefix("b179c952")
    assert not is_short_prefix("smol")


# -- flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ("serve", "--layer", "0:15"),
    ("generate", "--prompt", "hi", "--max-token", "3"),
    ("generate", "--prom", "hi"),
    ("model", "slice", "--lay", "0:15"),
])
def test_abbreviated_flags_are_refused(model, argv):
    line = one_error_line(cli(*argv, "--model", str(model)))
    # "--prom hi" leaves --prompt (or --chat) missing and "--lay" --layers; the others are unknown flags
    assert "unrecognized arguments" in line or "arguments are required" in line or "--chat is required" in line


@pytest.mark.parametrize(("flag", "value"), [("--peer", "localhost"), ("--peer", "127.0.0.1:"),
                                            ("--peer", "127.0.0.1:70000"), ("--spare", "localhost")])
def test_a_peer_without_a_port_is_refused(flag, value):
    argv = ["generate", "--prompt", "hi", flag, value]
    if flag == "--spare":
        argv += ["--peer", "127.0.0.1:1"]
    line = one_error_line(cli(*argv))
    assert flag in line
    assert "HOST:PORT" in line


# -- start-up failures -------------------------------------------------------------------


def test_a_busy_listen_port_is_one_line(model, node_factory, tmp_path):
    first = node_factory("0:15")  # a real node holds the port
    line = one_error_line(cli("serve", "--model", str(model), "--layers", "0:15", "--listen", first.endpoint,
                              "--state-dir", str(tmp_path / "s")))
    assert "cannot listen" in line
    assert "in use" in line
    with socket.socket() as s:  # and any other listener too
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(cli("serve", "--model", str(model), "--layers", "0:15", "--listen",
                                  f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s")))
    assert f"127.0.0.1:{port}" in line


def test_start_up_failures_are_one_line(model, tmp_path):
    state = ("--state-dir", str(tmp_path / "s"))
    serve = ("serve", "--layers", "0:15", *state)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("listen = \n")
    cases = [
        ((*serve, "--model", str(tmp_path / "missing.gguf")), 1, "MODEL_NOT_FOUND"),
        ((*serve, "--model", str(model), "--config", str(tmp_path / "nope.toml")), 2, "cannot read config"),
        ((*serve, "--model", str(model), "--config", str(tmp_path)), 2, "cannot read config"),
        ((*serve, "--model", str(model), "--config", str(bad_toml)), 2, "not valid TOML"),
        ((*serve, "--model", str(model), "--tracker", "notaurl"), 2, "--tracker"),
        ((*serve, "--model", str(model), "--tracker", "http://127.0.0.1:99999"), 2, "--tracker"),
        ((*serve, "--model", str(model), "--metrics", "127.0.0.1"), 2, "--metrics"),
        ((*serve, "--model", str(model), "--listen", "127.0.0.1"), 2, "--listen"),
        (("generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"), 1, "MODEL_NOT_FOUND"),
        (("generate", "--mesh", "x", "--tracker", "ftp://127.0.0.1:1", "--prompt", "hi"), 2, "--tracker"),
        (("model", "slice", "--model", str(tmp_path / "missing.gguf"), "--layers", "0:15"), 1, "MODEL_NOT_FOUND"),
    ]
    for argv, code, needle in cases:
        line = one_error_line(cli(*argv), code)
        assert needle in line, (argv, line)


# -- --mesh across a tracker -------------------------------------------------------------


@pytest.fixture
def tracker_url(tmp_path) -> Iterator[str]:
    proc, url = _start_tracker(tmp_path / "t.sqlite", ttl=10)
    yield url
    _stop(proc)


def test_mesh_finds_a_model_by_file_name_and_lists_what_it_saw(model, node_factory, tracker_url, tmp_path,
                                                               reference):
    own = tmp_path / "Meshtest-135M-Demo.Q4_1.gguf"  # a fingerprint and a file name of its own
    shutil.copyfile(model, own)
    with own.open("ab") as fh:
        fh.write(b"\0" * 64)
    fp = fingerprint(own)
    node_factory("0:30", source=own, extra=("--tracker", tracker_url, "--heartbeat", "1"), command="join")
    find = ("--tracker", tracker_url, "--prompt", PROMPT, "--max-tokens", "4", "--json", "--discover-timeout", "10")
    for query in ("meshtest-135m-demo", own.name, str(own), fp[:8].upper()):
        proc = cli("generate", "--mesh", query, *find)
        assert proc.returncode == 0, (query, proc.stderr)
        assert json.loads(proc.stdout)["tokens"] == reference.tokens[:4]
    miss = one_error_line(cli("generate", "--mesh", "no-such-model", *find[:-1], "1"))
    assert "models seen" in miss
    assert fp[:8] in miss
    short = one_error_line(cli("generate", "--mesh", fp[:6], *find))
    assert "8+" in short


# -- progress of a cut -------------------------------------------------------------------


def test_model_slice_reports_progress_and_a_summary_and_serve_streams_it(model, tmp_path):
    env = {**os.environ, "MESHNODE_CACHE_DIR": str(tmp_path / "cache")}  # an empty cache: a real cut
    proc = subprocess.run([sys.executable, "-m", "meshnode", "model", "slice", "--model", str(model),
                           "--layers", "3:9"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout stays one JSON object
    assert doc["range"] == [3, 9]
    lines = proc.stderr.strip().splitlines()
    assert any("writing layers 3:9 50% (" in ln for ln in lines), lines
    assert lines[-1].startswith(f"meshnode: layers 3:9 of {model.name} (middle): ")
    assert doc["dir"] in lines[-1]

    node = subprocess.Popen([sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--layers", "9:20",
                             "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"), "--ctx-size", "256",
                             "--max-sessions", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert node.stderr is not None
        seen = []
        for line in node.stderr:  # the child's progress arrives before the node listens
            seen.append(line)
            if line.startswith("meshnode: layers 9:20"):
                break
        assert any("cutting layers 9:20" in ln and "% (" in ln for ln in seen), seen
        assert node.stdout is not None
        assert "listening on" in node.stdout.readline()
    finally:
        node.terminate()
        node.wait(30)
        for pipe in (node.stdout, node.stderr):
            if pipe is not None:
                pipe.close()


def test_layer_ranges_name_the_flag_they_came_from() -> None:
    import argparse

    from bench.sizes import cut_list
    from meshnode.cli.main import parse_layers
    from meshnode.errors import LayerRangeError

    assert parse_layers("3:9") == (3, 9)
    with pytest.raises(LayerRangeError, match=r"--layers '9:3' is empty"):
        parse_layers("9:3")
    assert cut_list("0:12,12:24") == ["0:12", "12:24"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"--cuts '12' is not A:B"):
        cut_list("0:12,12")


def test_bench_variants_parse_or_are_refused() -> None:
    import argparse

    from bench.nodeenv import variant

    assert variant("default") == ("default", {})
    assert variant("spin:GOMP_SPINCOUNT=2000,X=") == ("spin", {"GOMP_SPINCOUNT": "2000", "X": ""})
    for bad in (":A=1", "v:A", "v:1A=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            variant(bad)
