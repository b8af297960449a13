"""The README runs as written: every ```sh block of README.md, in order, in one shell, as a user
pastes them, in a fresh state directory, checking what each block promises (issue 11, 2).

Hermetic: the blocks name fixed ports (7001-7005, 8700), so they run inside a Linux network
namespace this test creates (only its own loopback inside; torn down afterwards), where a
meshnode the user runs on those ports cannot be met. ``XDG_STATE_HOME`` is a temporary
directory; the model cache is the user's (``MESHNODE_CACHE_DIR``), so nothing is downloaded.
The shell runs in its own process group, killed at the end (the blocks' ``&`` processes).

Two commands are not run (replaced by ``true``), see SKIPPED: ``bash .ci/install`` set up the
very venv this test runs in (and compiles llama.cpp when it has to), and ``bash .ci/run`` runs
this suite, this test included. ``.venv`` is this test's venv, linked into a scratch checkout.
The install steps of docs/operations.md write under /opt and /etc: tests/test_systemd.py runs
them in a temporary root.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshnode.runtime.nodes import find_nodes
from meshnode.runtime.paths import cache_dir
from tests.conftest import cli

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
#: command -> why the test does not run it (it runs ``true`` instead)
SKIPPED = {
    "bash .ci/install": "set up the venv this test runs in; slow (compiles llama.cpp when not cached)",
    "bash .ci/run": "runs this test suite, this test included",
}


def sh_blocks(markdown: str) -> list[str]:
    """The ```sh fenced blocks of a Markdown text, in order. Pure."""
    return re.findall(r"^```sh\n(.*?)^```$", markdown, flags=re.M | re.S)


def _script(blocks: list[str], work: Path) -> Path:
    """One bash script sourcing each block in turn, its output to outN/errN; ``set -eu``: the
    first failing command (or unset variable) ends the run, and ``done N`` says how far it got."""
    lines = ["set -eu"]
    for i, block in enumerate(blocks):
        for cmd in SKIPPED:
            block = block.replace(cmd, "true")
        (work / f"block{i}.sh").write_text(block)
        lines.append(f"source block{i}.sh >out{i} 2>err{i}; echo done {i}")
    (work / "readme.sh").write_text("\n".join(lines) + "\n")
    return work / "readme.sh"


def _netns(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _run_in_netns(script: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    ns = f"meshnode-readme-{os.getpid()}"
    _netns("netns", "add", ns)
    try:
        _netns("-n", ns, "link", "set", "lo", "up")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "bash", str(script)], cwd=script.parent, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            _kill_group(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        _netns("netns", "del", ns)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """The shell's process group: the tracker and nodes the blocks started with ``&``.
    SIGTERM (nodes drain and leave), up to 20 s for the group to be gone, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + 20
        try:
            os.killpg(proc.pid, sig)
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)  # ProcessLookupError once no member is left
                time.sleep(0.2)
        except ProcessLookupError:
            break
    if proc.poll() is None:
        proc.wait(10)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_sh_blocks_are_found_in_order():
    assert sh_blocks("a\n```sh\nx\n```\n```text\ny\n```\n```sh\nz 1\nz 2\n```\n") == ["x\n", "z 1\nz 2\n"]


def test_the_readme_runs_as_written(tmp_path, model):
    readme = (ROOT / "README.md").read_text()
    blocks = sh_blocks(readme)
    assert len(blocks) == 7, "a new README block: give it its checks below"
    for cmd in SKIPPED:
        assert cmd in readme, f"{cmd!r} is no longer in the README: update SKIPPED"
    work = tmp_path / "checkout"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)
    assert (work / ".venv" / "bin" / "meshnode").exists()
    state = tmp_path / "state"
    env = {**os.environ, "XDG_STATE_HOME": str(state), "MESHNODE_CACHE_DIR": str(cache_dir())}
    env.pop("STATE_DIRECTORY", None)
    local64 = cli("generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "64", "--temperature", "0",
                  "--json")
    assert local64.returncode == 0, local64.stderr

    run = _run_in_netns(_script(blocks, work), env, timeout=900)
    out = [(work / f"out{i}").read_text() if (work / f"out{i}").exists() else "" for i in range(len(blocks))]
    err = [(work / f"err{i}").read_text() if (work / f"err{i}").exists() else "" for i in range(len(blocks))]
    assert run.returncode == 0, f"stopped after: {run.stdout!r}\n" + "\n".join(
        f"--- block {i}\n{o[-1500:]}\n{e[-1500:]}" for i, (o, e) in enumerate(zip(out, err, strict=True)))
    assert run.stdout.split() == [w for i in range(len(blocks)) for w in ("done", str(i))]

    # 0: the demo generates across two node processes
    assert "The three primary colors are" in out[0]
    assert "tokens across 2 hops" in err[0]
    # 1: bash .ci/run, replaced by true (SKIPPED)
    # 2: two nodes, both serving; the route's text is the whole model's
    for port in (7001, 7002):
        assert f"listening on 127.0.0.1:{port}" in out[2]
    assert len(re.findall(r"^node \w+  127\.0\.0\.1:700[12]  .* serving ", out[2], flags=re.M)) == 2  # status
    route, whole = _json_lines(out[2])
    assert route["route"] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert route["text"].strip()
    assert route["text"] == whole["text"]
    # 3: the tracker; --auto takes the range the mesh lacks; a route found by name; one node leaves
    assert "listening on 127.0.0.1:8700" in out[3]
    assert "--auto chose layers 15:30" in err[3]
    (mesh,) = _json_lines(out[3])
    assert mesh["route"] == ["127.0.0.1:7004", "127.0.0.1:7005"]
    assert mesh["text"].strip()
    assert re.search(r"node \w+ \(layers 15:30, 127\.0\.0\.1:7005\) has left", out[3])
    # 4: sampling with a drawn seed, reported; the text cut before the stop string
    (sampled,) = _json_lines(out[4])
    assert isinstance(sampled["seed"], int)
    assert f"seed {sampled['seed']}" in err[4]
    assert "." not in sampled["text"]
    # 5: the API: the model listed by its file name; a chat answer
    (models, chat) = _json_lines(out[5])
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"].strip()
    # 6: a route with a spare streams the whole model's text; leave --all stops the four nodes left
    assert "listening on 127.0.0.1:7003" in out[6]
    assert json.loads(local64.stdout)["text"] in out[6]
    assert sorted(re.findall(r"127\.0\.0\.1:(\d+)\) has left", out[6])) == ["7001", "7002", "7003", "7004"]
    assert find_nodes(state / "meshnode") == []
