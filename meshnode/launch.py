"""Start ``meshnode serve`` child processes and wait until they really serve.

Used by ``meshnode demo`` and the benchmark; the tests have a trio twin.
A node prints one line containing ``listening on HOST:PORT`` once its gRPC
server accepts connections; nothing here sleeps and hopes.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshnode.errors import PeerError

LISTENING = re.compile(r"listening on (\S+:\d+)")


@dataclass
class NodeProcess:
    proc: subprocess.Popen[str]
    endpoint: str
    layers: str

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_node(model: Path, layers: str, *, extra: Sequence[str] = (), timeout: float = 120.0) -> NodeProcess:
    cmd = [sys.executable, "-m", "meshnode", "serve", "--model", str(model), "--layers", layers,
           "--listen", "127.0.0.1:0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = LISTENING.search(line)
        if m:
            return NodeProcess(proc, m.group(1), layers)
    proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    raise PeerError(f"node for layers {layers} did not start: {err.strip()[-400:]}")


@contextlib.contextmanager
def local_route(model: Path, cuts: Sequence[str], extra: Sequence[str] = ()) -> Iterator[list[NodeProcess]]:
    nodes: list[NodeProcess] = []
    try:
        for c in cuts:
            nodes.append(start_node(model, c, extra=extra))
        yield nodes
    finally:
        for n in nodes:
            n.stop()
