"""The tests never meet the user's own nodes: with a meshnode daemon holding the default state
dir of the user's HOME, the suite's default-state-dir tests still pass, and the daemon is left
alone (issue 11, 3). The "user" is a temporary HOME; the model cache is shared (only read)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from meshnode.runtime.launch import LISTENING
from meshnode.runtime.nodes import probe
from meshnode.runtime.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def _user_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_STATE_HOME", "STATE_DIRECTORY")}
    return {**env, "HOME": str(home), "MESHNODE_CACHE_DIR": str(cache_dir())}


def test_the_suite_passes_beside_a_daemon_on_the_default_state_dir(tmp_path, model):
    home = tmp_path / "home"
    env = _user_env(home)
    daemon = subprocess.Popen([sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--layers", "0:15"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert daemon.stdout is not None
        assert LISTENING.search(daemon.stdout.readline())
        user_state = home / ".local" / "state" / "meshnode"
        held = probe(user_state)
        assert held is not None
        assert held.pid == daemon.pid
        key = hashlib.sha256((user_state / "node.key").read_bytes()).hexdigest()
        files = sorted(p.relative_to(user_state) for p in user_state.rglob("*"))

        # as the user would run them: the files whose default-state-dir cases failed before
        # (test_bad_input: the daemon's lock answered before the flag checks) or start nodes
        # without --state-dir (test_runtime)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_bad_input.py", "tests/test_runtime.py"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert " passed" in proc.stdout

        assert daemon.poll() is None  # still serving, its state untouched
        assert probe(user_state) == held
        assert hashlib.sha256((user_state / "node.key").read_bytes()).hexdigest() == key
        assert sorted(p.relative_to(user_state) for p in user_state.rglob("*")) == files
    finally:
        daemon.terminate()
        daemon.communicate(timeout=60)
