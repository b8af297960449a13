"""Start ``meshnode serve`` child processes and wait until they really serve.

Used by ``meshnode demo`` and the benchmark; the tests have a trio twin.
A node prints one line containing ``listening on HOST:PORT`` once its gRPC
server accepts connections; nothing here sleeps and hopes.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from meshnode.errors import PeerError

LISTENING = re.compile(r"listening on (\S+:\d+)")


@dataclass
class NodeProcess:
    proc: subprocess.Popen[str]
    endpoint: str
    layers: str
    #: the node's stderr (a temporary file)
    log: IO[str]
    #: the node's state directory, if it is a temporary one of its own
    state: tempfile.TemporaryDirectory[str] | None = None

    @property
    def state_dir(self) -> Path | None:
        return Path(self.state.name) if self.state is not None else None

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        if self.state is not None:
            self.state.cleanup()


def start_node(model: Path | None, layers: str | None, *, extra: Sequence[str] = (), timeout: float = 120.0,
               state_dir: Path | None = None, command: str = "serve", log_json: bool = False,
               cpus: Sequence[int] = (), prefix: Sequence[str] = (), listen: str = "127.0.0.1:0",
               env: dict[str, str] | None = None) -> NodeProcess:
    """A ``meshnode serve`` child on 127.0.0.1, port 0; each gets its own identity
    (a fresh temporary state directory) unless ``state_dir`` is given. ``log_json``:
    its log (``stderr()``) is JSON lines at INFO, as under systemd. ``cpus``: run it
    under ``taskset -c`` on those CPUs only (a machine of its own, as the benchmark
    simulates one). ``prefix``: a command it runs under (``ip netns exec NS``: a host of
    its own, bench/netlab.py), listening on ``listen``."""
    own_state = None
    if state_dir is None:
        own_state = tempfile.TemporaryDirectory(prefix="meshnode-state-")
        state_dir = Path(own_state.name)
    cmd = [*prefix, *taskset(cpus), sys.executable, "-m", "meshnode", *(["--log-json"] if log_json else []), command,
           *(["--model", str(model)] if model is not None else []),
           *(["--layers", layers] if layers else []), "--listen", listen, "--state-dir", str(state_dir), *extra]
    log = tempfile.TemporaryFile(mode="w+")  # owned (and closed) by NodeProcess
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=None if env is None else {**os.environ, **env})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = LISTENING.search(line)
        if m:
            return NodeProcess(proc, m.group(1), layers or _layers_of(line), log, own_state)
    proc.kill()
    proc.wait()
    log.seek(0)
    err = log.read()
    log.close()
    if own_state is not None:
        own_state.cleanup()
    raise PeerError(f"node for layers {layers} did not start: {err.strip()[-600:]}")


def taskset(cpus: Sequence[int]) -> list[str]:
    """The command prefix that runs a program on ``cpus`` only (none: anywhere)."""
    return ["taskset", "-c", ",".join(str(c) for c in sorted(cpus))] if cpus else []


def _layers_of(line: str) -> str:
    m = re.search(r"serving layers (\d+:\d+)", line)
    return m.group(1) if m else "?"


@contextlib.contextmanager
def local_route(model: Path, cuts: Sequence[str], extra: Sequence[str] = (),
                cpus: Sequence[Sequence[int]] = (), env: dict[str, str] | None = None) -> Iterator[list[NodeProcess]]:
    """A node per cut; ``cpus``: each node's CPUs (``taskset``), in cut order; ``env``: variables set for
    every node over this process's environment."""
    nodes: list[NodeProcess] = []
    try:
        for i, c in enumerate(cuts):
            nodes.append(start_node(model, c, extra=extra, cpus=cpus[i] if cpus else (), env=env))
        yield nodes
    finally:
        for n in nodes:
            n.stop()
