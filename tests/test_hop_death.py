"""A hop killed mid-generation: a structured failure naming the hop, within the deadline.

The initiator runs as its own process (``meshnode generate``), as users run it.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import trio

from tests.conftest import PROMPT


@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_killing_a_hop_mid_generation_fails_fast_and_names_it(node_factory, victim):
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ("0:7", "7:19", "19:30")]
    peers = [a for n in nodes for a in ("--peer", n.endpoint)]
    cmd = [sys.executable, "-m", "meshnode", "generate", *peers, "--prompt", PROMPT, "--max-tokens", "400", "--json"]
    with trio.fail_after(60):  # 400 tokens would take ~10 s; the step deadline is 30 s
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            await trio.sleep(2.5)  # the initiator starts (~1 s) and decodes: "mid-generation"
            assert proc.returncode is None, "the generation ended before the kill"
            nodes[victim].proc.send_signal(signal.SIGKILL)
            assert proc.stderr is not None
            err = b""
            while chunk := await proc.stderr.receive_some():
                err += chunk
            await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if proc.stderr is not None:
                await proc.stderr.aclose()
    text = err.decode()
    assert proc.returncode == 1, text
    assert "meshnode: error: PEER_UNAVAILABLE" in text
    assert f"[hop {nodes[victim].endpoint}]" in text
