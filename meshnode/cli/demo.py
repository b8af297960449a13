"""``meshnode demo``: the README's first command, end to end on this machine.

Pulls the default model (verified, cached), starts two node processes on
loopback serving layers 0:15 and 15:30, generates across that route, and
prints the text and the route's decode rate.
"""

from __future__ import annotations

import sys

import trio

from meshnode.gguf import inspect_model
from meshnode.models import pull
from meshnode.runtime.launch import local_route
from meshnode.session.initiator import GenerateConfig, GenerationResult, generate
from meshnode.transport.aiothread import open_aio_thread


def run_demo(prompt: str, max_tokens: int) -> int:
    model = pull()
    n = inspect_model(model).n_layer
    cuts = [f"0:{n // 2}", f"{n // 2}:{n}"]
    print(f"meshnode: starting a local route of {len(cuts)} node processes: {', '.join(cuts)}", file=sys.stderr)
    with local_route(model, cuts) as nodes:
        peers = [node.endpoint for node in nodes]
        print(f"meshnode: route {' -> '.join(peers)}", file=sys.stderr)

        async def main() -> GenerationResult:
            async with open_aio_thread(name="meshnode-initiator") as aio:
                cfg = GenerateConfig(prompt=prompt, max_tokens=max_tokens)
                result: GenerationResult = await aio.run(generate, peers, cfg)
                return result

        result = trio.run(main)
    print(prompt + result.text)
    rate = (len(result.tokens) - 1) / result.decode_seconds if result.decode_seconds else 0.0
    print(f"meshnode: {len(result.tokens)} tokens across {len(cuts)} hops, {rate:.1f} tokens/s decode", file=sys.stderr)
    return 0
