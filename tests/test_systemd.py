"""The systemd units verify, and the node speaks the notify protocol for real."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("unit", "binary"), [("meshnode.service", "meshnode"),
                                              ("meshnode-tracker.service", "meshnode-tracker")])
def test_units_pass_systemd_analyze_verify(tmp_path, unit, binary):
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is installed by the test setup on this machine kind"
    text = (ROOT / "systemd" / unit).read_text()
    # the units name the install location /opt/meshnode; point them at this checkout's venv
    venv_bin = Path(sys.executable).parent
    text = text.replace(f"/opt/meshnode/venv/bin/{binary}", str(venv_bin / binary))
    assert str(venv_bin) in text
    (tmp_path / unit).write_text(text)
    proc = subprocess.run([tool, "verify", str(tmp_path / unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Type=notify" in text or unit.startswith("meshnode-tracker")


def _install_block() -> str:
    """The install steps of docs/operations.md: its ```sh block that takes DESTDIR."""
    from tests.test_readme import sh_blocks

    (block,) = [b for b in sh_blocks((ROOT / "docs" / "operations.md").read_text()) if "DESTDIR" in b]
    return block


def _wheel(tmp: Path) -> Path:
    """A meshnode wheel of this checkout, built from a copy (the build leaves the tree alone)."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                              ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(tmp / "wheel"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "wheel").glob("meshnode-*.whl")
    return wheel


def test_the_documented_install_verifies_in_a_temporary_root(tmp_path):
    """docs/operations.md's install steps, run as written with DESTDIR a temporary root; the
    installed units verify there with their installed paths (ExecStart must exist and be
    executable under --root). The dependencies are not downloaded (--no-deps)."""
    root = tmp_path / "root"
    # no PYTHONPATH: the new venv must see only what it installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"DESTDIR": str(root), "SRC": str(_wheel(tmp_path)), "PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(["bash", "-eu", "-c", _install_block()], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    venv = root / "opt" / "meshnode" / "venv"
    # the service user must reach the interpreter: the venv's base is Debian's, not a home directory's
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    assert cfg["home"] == "/usr/bin"
    assert not cfg["executable"].startswith(("/root", "/home"))
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import meshnode.runtime.nodes; print(meshnode.__file__)"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.stdout.startswith(str(venv)), out.stdout
    assert out.returncode == 0, out.stderr
    from meshnode import config

    assert config.load(root / "etc" / "meshnode" / "node.toml")["layers"] == "0:15"  # the example is valid
    # verify resolves the units' dependencies (sysinit.target, ...) inside the root: give it the system's
    shutil.copytree("/usr/lib/systemd/system", root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is installed by .ci/install"
    for unit, binary in (("meshnode.service", "meshnode"), ("meshnode-tracker.service", "meshnode-tracker")):
        installed = root / "etc" / "systemd" / "system" / unit
        assert f"ExecStart=/opt/meshnode/venv/bin/{binary} " in installed.read_text()
        assert os.access(venv / "bin" / binary, os.X_OK)
        proc = subprocess.run([tool, "verify", f"--root={root}", f"/etc/systemd/system/{unit}"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    # and the check is real: an ExecStart that is not executable fails it
    (venv / "bin" / "meshnode").chmod(0o644)
    proc = subprocess.run([tool, "verify", f"--root={root}", "/etc/systemd/system/meshnode.service"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "is not executable" in proc.stderr


def test_node_sends_ready_watchdog_and_stopping(tmp_path, model):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(120)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"}
    proc = subprocess.Popen([sys.executable, "-m", "meshnode", "join", "--model", str(model), "--layers", "0:15",
                             "--state-dir", str(tmp_path / "st"), "--drain-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        got: list[str] = []
        while "READY=1" not in got:
            got.append(sock.recv(256).decode())
        # READY only once the node really serves: its endpoint answers
        line = proc.stdout.readline()
        assert "listening on" in line
        endpoint = line.rsplit(" ", 1)[1].strip()
        host, port = endpoint.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
        while "WATCHDOG=1" not in got:
            got.append(sock.recv(256).decode())
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in got:
            got.append(sock.recv(256).decode())
        assert proc.wait(60) == 0
        assert got.index("READY=1") < got.index("STOPPING=1")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        sock.close()


def test_logs_are_json_lines_for_the_journal(tmp_path, model):
    import json

    env = {**os.environ, "JOURNAL_STREAM": "8:12345"}  # what systemd sets when stderr is the journal
    proc = subprocess.Popen([sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--layers", "0:15",
                             "--state-dir", str(tmp_path / "st")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(r["msg"].startswith("serving head layers 0:15") for r in records), err
    assert any("draining" in r["msg"] for r in records)
    assert all({"ts", "level", "logger", "msg", "pid"} <= set(r) for r in records)
