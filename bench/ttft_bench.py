"""Time to the first token through the streaming API: ``python -m bench.ttft_bench`` (issue 26, item 5).

A prompt of 256 tokens (route_bench's paragraph, cut to 256 tokens of the model's own vocabulary), greedy,
``max_tokens`` 16: the time from sending the request to the first streamed text through ``meshnode api``
over a two-hop route of ``meshnode serve`` halves (the official ``openai`` client, ``stream=True``),
against ``Llama.create_completion(stream=True)`` on the whole model in a process of its own, each
measured in turn, ``--rounds`` times; medians printed side by side, with their ratio. A different
prompt each round (its first word changed), so no hop's KV holds it from the round before.

    python -m bench.ttft_bench [--model GGUF] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 256


def _prompt(model: Path, variant: int) -> str:
    """A text of exactly ``PROMPT_TOKENS`` tokens of the model (with its BOS) for round ``variant``."""
    from llama_cpp import Llama

    from bench.route_bench import LONG_TEXT

    llm = Llama(str(model), vocab_only=True, verbose=False)
    ids = llm.tokenize(f"Round {variant}. {LONG_TEXT * 6}".encode())[: PROMPT_TOKENS]
    return llm.detokenize(ids[1:] if ids and ids[0] == llm.token_bos() else ids).decode(errors="ignore")


def whole_child(model: str, prompt: str, threads: int) -> None:
    from llama_cpp import Llama

    llm = Llama(model, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.create_completion("warm up", max_tokens=2, temperature=0)
    t0 = time.perf_counter()
    first = None
    for chunk in llm.create_completion(prompt, max_tokens=16, temperature=0, stream=True):
        if first is None and chunk["choices"][0]["text"]:
            first = time.perf_counter() - t0
    print(json.dumps({"ttft": first}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ttft_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="the whole model's threads")
    ap.add_argument("--whole-child", nargs=2, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.whole_child:
        whole_child(ns.whole_child[0], ns.whole_child[1], ns.threads)
        return 0
    import openai

    from bench import paths
    from meshnode.gguf.model import inspect_model
    from meshnode.models import pull
    from meshnode.runtime.launch import local_route

    model = Path(ns.model) if ns.model else pull()
    n = inspect_model(model).n_layer
    print(f"command: python -m bench.ttft_bench {' '.join(sys.argv[1:] if argv is None else argv)}\n"
          f"model {model.name}: a {PROMPT_TOKENS}-token prompt, greedy, the first streamed text", flush=True)
    route_t, whole_t = [], []
    with local_route(model, [f"0:{n // 2}", f"{n // 2}:{n}"]) as nodes, \
            paths.api_gateway([x.endpoint for x in nodes]) as url, \
            openai.OpenAI(base_url=url, api_key="unused") as client:
        name = client.models.list().data[0].id
        client.completions.create(model=name, prompt="warm up", max_tokens=2, temperature=0)
        for i in range(ns.rounds):
            prompt = _prompt(model, i)
            t0 = time.perf_counter()
            first = None
            for chunk in client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0,
                                                   stream=True):
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - t0
            route_t.append(first or float("nan"))
            done = subprocess.run([sys.executable, "-m", "bench.ttft_bench", "--threads", str(ns.threads),
                                   "--whole-child", str(model), prompt], capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parents[1])
            whole_t.append(json.loads(done.stdout.strip().splitlines()[-1])["ttft"])
            print(f"  round {i + 1}: route via the API {1e3 * route_t[-1]:.1f} ms, whole model (Llama, "
                  f"{ns.threads} threads) {1e3 * whole_t[-1]:.1f} ms", flush=True)
    r, w = statistics.median(route_t), statistics.median(whole_t)
    print(f"\n| time to first token, {PROMPT_TOKENS}-token prompt | median of {ns.rounds} |\n|---|---|\n"
          f"| `meshnode api` (stream) over 2 hops | {1e3 * r:.1f} ms |\n"
          f"| `Llama.create_completion(stream=True)`, whole model | {1e3 * w:.1f} ms |\n| ratio | {r / w:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
