"""One node per state dir, held by a real lock; several nodes on one machine without inventing
state dirs; ``status`` and ``leave`` find each node they started (meshnode/runtime/nodes.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshnode import errors
from meshnode.runtime.launch import LISTENING
from meshnode.runtime.nodes import RuntimeDir, address_key, default_state_dir, find_nodes, probe
from tests.conftest import cli


def test_default_state_dirs_are_per_listen_address():
    base = Path("/s")
    assert default_state_dir(base, "127.0.0.1", 0) == base
    assert default_state_dir(base, "127.0.0.1", 7002) == base / "nodes" / "127.0.0.1_7002"
    assert address_key("::1", 7001) == "__1_7001"
    assert address_key("../x", 1) == ".._x_1"  # no separator survives: the dir stays under nodes/


def test_the_lock_admits_one_holder_and_frees_on_release(tmp_path):
    first, second = RuntimeDir(tmp_path), RuntimeDir(tmp_path)
    assert probe(tmp_path) is None
    first.claim(hint="HINT")
    try:
        found = probe(tmp_path)
        assert found is not None
        assert found.pid == os.getpid()
        assert found.info is None
        with pytest.raises(errors.InputError, match=f"pid {os.getpid()}.*{tmp_path}: HINT"):
            second.claim(hint="HINT")
        first.write(endpoint="127.0.0.1:1", listen="127.0.0.1:1")
        (running,) = find_nodes(tmp_path)
        assert running.matches("127.0.0.1:1")
        assert not running.matches("127.0.0.1:2")
    finally:
        first.release()
    assert probe(tmp_path) is None
    assert not (tmp_path / "node.json").exists()
    second.claim(hint="HINT")
    second.release()


def test_leave_refuses_a_node_still_starting(tmp_path):
    """A node that holds its lock but serves not yet (no node.json of its own) is not signalled."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from meshnode.runtime.nodes import RuntimeDir; "
                               "RuntimeDir(Path(sys.argv[1])).claim(hint=''); "
                               "print('held', flush=True); sys.stdin.read()", str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        proc = cli("leave", "--state-dir", str(tmp_path))
        assert proc.returncode == 2
        assert f"still starting: pid {holder.pid}, starting" in proc.stderr
        assert "status --wait" in proc.stderr
        assert holder.poll() is None
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model: Path, layers: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--layers", layers,
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _listening(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        m = LISTENING.search(line)
        if m:
            return m.group(1)
    raise AssertionError(f"exited {proc.wait()}: {proc.stderr.read() if proc.stderr else ''}")


def _reap(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


def test_two_serves_on_one_state_dir_started_together_one_wins(tmp_path, model):
    procs = [_serve(model, "0:15", "--state-dir", str(tmp_path / "st")) for _ in range(2)]
    try:
        deadline = time.monotonic() + 180
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)  # bounded: until the loser exits (its checks, then the lock)
        rcs = [p.poll() for p in procs]
        assert sorted(rcs, key=str) == [2, None], rcs
        err = procs[rcs.index(2)].communicate()[1]
        assert err.count("\n") == 1, err
        assert "already runs with state dir" in err
        assert "--state-dir" in err
        _listening(procs[rcs.index(None)])
    finally:
        _reap(*procs)


def test_a_killed_node_leaves_no_stale_claim(tmp_path, model):
    st = tmp_path / "st"
    first = _serve(model, "0:15", "--state-dir", str(st))
    try:
        _listening(first)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        assert json.loads((st / "node.json").read_text())["pid"] == first.pid  # left behind, but not believed
        proc = cli("status", "--state-dir", str(st))
        assert proc.returncode == 2
        assert "no node is running" in proc.stderr
        second = _serve(model, "0:15", "--state-dir", str(st))
        try:
            _listening(second)
        finally:
            _reap(second)
    finally:
        _reap(first)


def test_nodes_without_state_dirs_are_found_by_status_and_leave(model, own_state_home):
    ports = [_free_port(), _free_port()]
    procs = [_serve(model, ly, "--listen", f"127.0.0.1:{p}") for ly, p in zip(("0:15", "15:30"), ports, strict=True)]
    ephemeral = _serve(model, "15:30")  # port 0: the default state dir itself
    try:
        endpoints = [_listening(p) for p in (*procs, ephemeral)]
        assert endpoints[:2] == [f"127.0.0.1:{p}" for p in ports]
        base = own_state_home / "meshnode"
        assert {r.state_dir for r in find_nodes(base)} == {base, *(base / "nodes" / f"127.0.0.1_{p}" for p in ports)}

        again = cli("serve", "--model", str(model), "--layers", "0:15")  # port 0 again: the default dir is held
        assert again.returncode == 2
        assert "--listen HOST:PORT" in again.stderr
        assert "--state-dir" in again.stderr

        st = cli("status", "--json", "--wait", "30", *(f"--listen=127.0.0.1:{p}" for p in ports))
        assert st.returncode == 0, st.stderr
        assert sorted(n["endpoint"] for n in json.loads(st.stdout)["nodes"]) == sorted(endpoints[:2])
        st = cli("status", "--json")
        rows = json.loads(st.stdout)["nodes"]
        assert sorted(n["endpoint"] for n in rows) == sorted(endpoints)
        ident = cli("id", "--listen", endpoints[0])  # each fixed address has its own key
        assert ident.stdout.strip() == next(n["node_id"] for n in rows if n["endpoint"] == endpoints[0])
        assert len({n["node_id"] for n in rows}) == 3

        lv = cli("leave")
        assert lv.returncode == 2
        assert lv.stderr.count("\n") == 1
        assert "3 nodes run under" in lv.stderr
        assert "--listen HOST:PORT, --state-dir DIR or --all" in lv.stderr
        lv = cli("leave", "--listen", endpoints[2])
        assert lv.returncode == 0, lv.stderr
        assert ephemeral.wait(30) == 0
        lv = cli("leave", "--all")
        assert lv.returncode == 0, lv.stderr
        assert [p.wait(30) for p in procs] == [0, 0]
        assert cli("status").returncode == 2
    finally:
        _reap(*procs, ephemeral)
