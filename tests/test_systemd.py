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
    text = text.replace(f"/opt/meshnode/.venv/bin/{binary}", str(venv_bin / binary))
    assert str(venv_bin) in text
    (tmp_path / unit).write_text(text)
    proc = subprocess.run([tool, "verify", str(tmp_path / unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Type=notify" in text or unit.startswith("meshnode-tracker")


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
