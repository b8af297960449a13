"""A hop killed mid-generation: a structured failure naming the hop, within the deadline.

The initiator runs as its own process (``meshnode generate``), as users run it.
"""

from __future__ import annotations

import signal
import sys

import pytest
import trio

from tests.conftest import PROMPT, initiator


@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_killing_a_hop_mid_generation_fails_fast_and_names_it(node_factory, victim):
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ("0:7", "7:19", "19:30")]
    peers = [a for n in nodes for a in ("--peer", n.endpoint)]
    cmd = [sys.executable, "-m", "meshnode", "generate", *peers, "--prompt", PROMPT, "--max-tokens", "400", "--json"]
    # 400 tokens would take ~10 s; the step deadline is 30 s
    async with initiator(cmd, timeout=60) as run:
        await trio.sleep(2.5)  # the initiator starts (~1 s) and decodes: "mid-generation"
        assert run.proc.returncode is None, "the generation ended before the kill"
        nodes[victim].proc.send_signal(signal.SIGKILL)
    text = run.text()
    assert run.proc.returncode == 1, text
    assert "meshnode: error: PEER_UNAVAILABLE" in text
    assert f"[hop {nodes[victim].endpoint}]" in text
