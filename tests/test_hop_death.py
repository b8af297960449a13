"""A hop killed mid-generation: a structured failure naming the hop, within the deadline."""

from __future__ import annotations

import signal

import pytest
import trio
import trio_asyncio

from meshnode import errors
from meshnode.session.initiator import GenerateConfig, generate
from tests.conftest import PROMPT


@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_killing_a_hop_mid_generation_fails_fast_and_names_it(node_factory, victim):
    nodes = [await trio.to_thread.run_sync(node_factory, layers) for layers in ("0:7", "7:19", "19:30")]
    peers = [n.endpoint for n in nodes]
    cfg = GenerateConfig(prompt=PROMPT, max_tokens=400, step_timeout=10.0)
    failure: list[BaseException] = []

    async def run() -> None:
        try:
            await trio_asyncio.aio_as_trio(generate)(peers, cfg)
        except errors.MeshnodeError as e:
            failure.append(e)

    with trio.fail_after(30):  # far below 400 tokens' worth, far above the 10 s step deadline
        async with trio_asyncio.open_loop(), trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.sleep(1.0)  # let it decode a while: this is the "mid-generation" moment
            nodes[victim].proc.send_signal(signal.SIGKILL)
    assert len(failure) == 1, "the generation must fail, not hang or finish"
    err = failure[0]
    assert isinstance(err, errors.PeerError)
    assert err.hop == peers[victim]
