"""The two sides of every comparison, as users run them, for ``python -m bench``.

* The whole model: ``llama_cpp.Llama`` in a child process of its own (``route_bench``'s and
  ``batch_bench``'s whole-model children, or ``prefill_child`` here), optionally under ``taskset``.
* The route: ``meshnode generate`` processes and the OpenAI API (``meshnode api`` + the ``openai``
  client), each decode rate measured *by difference* of a long and a short generation of the same
  prompt, so process start-up, route checks, session open and prefill cancel out.

Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from meshnode.runtime.launch import taskset

ROOT = Path(__file__).resolve().parents[1]
#: greedy SmolLM2 runs on past 200 tokens after this prompt without an end-of-generation token
PROMPT = "The three primary colors are"
SHORT, LONG = 16, 208


#: the whole model's child runs with the weights in huge pages, as a node does (meshnode/executor/hugepages.py):
#: its fastest setting on this machine kind. ``BENCH_BASELINE_PAGES=small`` runs it as ``Llama`` starts by itself.
BASELINE_HUGE = os.environ.get("BENCH_BASELINE_PAGES", "huge") != "small"


def baseline_env() -> dict[str, str]:
    """The environment of a whole-model child: the node's huge-page tunable unless BENCH_BASELINE_PAGES=small."""
    from meshnode.executor.hugepages import env_here

    return (env_here(os.environ) if BASELINE_HUGE else None) or dict(os.environ)


def huge_pages_here() -> None:
    """An in-process benchmark (llama.cpp in this process) starts again with the node's huge pages, unless
    BENCH_BASELINE_PAGES=small: what it measures is then what a node runs."""
    if BASELINE_HUGE:
        from meshnode.executor.hugepages import reexec_with_huge_pages

        reexec_with_huge_pages()


def _child(args: Sequence[str], cpus: Sequence[int] = ()) -> dict[str, Any]:
    """Run ``python -m bench.X ...`` (its last stdout line is one JSON object)."""
    done = subprocess.run([*taskset(cpus), sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          env=baseline_env())
    if done.returncode != 0:
        raise RuntimeError(f"python -m {args[0]} {args[1]} failed: {done.stderr.strip()[-800:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def whole_decode(model: Path, threads: int, tokens: int, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """``Llama`` (default context, ``threads`` for decode and batch): greedy decode tok/s and its tokens."""
    return _child(["bench.route_bench", "--whole-child", "--model", str(model), "--tokens", str(tokens),
                   "--threads", str(threads), "--threads-batch", str(threads)], cpus)


def whole_batched(model: Path, sessions: int, threads: int, tokens: int, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """The whole model decoding ``sessions`` sequences as one batch per step (``batch_bench``'s child)."""
    r = _child(["bench.batch_bench", "--whole-child", "--model", str(model), "--tokens", str(tokens),
                "--threads", str(threads), "--threads-batch", str(threads), "--sessions", str(sessions),
                "--max-sessions", str(sessions)], cpus)
    return {"ids": r["ids"], **r["by_n"][str(sessions)]}


def halves(model: Path) -> list[str]:
    """The model's layers cut in two (``["0:h", "h:n"]``), each range's file written if it is not yet."""
    from meshnode.gguf import ensure_range
    from meshnode.gguf.report import describe

    n = describe(model)["layers"]
    cuts = [(0, n // 2), (n // 2, n)]
    for a, b in cuts:
        ensure_range(model, a, b)
    return [f"{a}:{b}" for a, b in cuts]


def long_prompt(repeat: int) -> str:
    """A prompt of ``repeat`` copies of route_bench's paragraph (~79 tokens each)."""
    from bench.route_bench import LONG_TEXT

    return LONG_TEXT * repeat


def prefill_child(model: str, text: str, threads: int, n_ctx: int) -> dict[str, Any]:
    """In a child: ``Llama.eval`` of the whole prompt (chunked by n_batch 512, as a route's prefill), warm."""
    import llama_cpp

    llm = llama_cpp.Llama(model, verbose=False, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          use_mmap=False)  # read into memory, as a node does (route_bench.whole_child)
    ids = llm.tokenize(text.encode(), add_bos=True, special=True)
    llm.eval(ids[:600])  # warm-up: the graphs of a full and a partial chunk
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return {"prefill_s": time.perf_counter() - t0, "n_tokens": len(ids)}


def whole_prefill(model: Path, repeat: int, threads: int, n_ctx: int, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """Prefill seconds of ``long_prompt(repeat)`` in ``Llama`` (a child process)."""
    return _child(["bench", "--prefill-child", "--model", str(model), "--repeat", str(repeat), "--threads",
                   str(threads), "--ctx-size", str(n_ctx)], cpus)


def generate(peers: Sequence[str], prompt: str, max_tokens: int,
             cpus: Sequence[int] = (), extra: Sequence[str] = (),
             prefix: Sequence[str] = ()) -> tuple[float, dict[str, Any]]:
    """One ``meshnode generate`` process, greedy: (wall seconds, its --json result). Its initiator key lives
    in a temporary state directory, not the user's ~/.local/state."""
    cmd = [*prefix, *taskset(cpus), sys.executable, "-m", "meshnode", "generate",
           *[a for p in peers for a in ("--peer", p)], "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--json", *extra]
    with tempfile.TemporaryDirectory(prefix="meshnode-gen-") as state:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "XDG_STATE_HOME": state})
        seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"meshnode generate failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return seconds, json.loads(done.stdout.strip().splitlines()[-1])


def cli_decode(peers: Sequence[str], runs: int, cpus: Sequence[int] = (),
               extra: Sequence[str] = (), prefix: Sequence[str] = ()) -> dict[str, Any]:
    """Decode tok/s through the CLI, by difference: (tokens_long - tokens_short) / (wall_long - wall_short)."""
    generate(peers, PROMPT, 4, cpus, extra, prefix)  # warm-up
    rates, inner, tokens = [], [], []
    for _ in range(runs):
        ts, short = generate(peers, PROMPT, SHORT, cpus, extra, prefix)
        tl, long = generate(peers, PROMPT, LONG, cpus, extra, prefix)
        rates.append((len(long["tokens"]) - len(short["tokens"])) / (tl - ts))
        inner.append(long["decode_tokens_per_second"])
        tokens = long["tokens"]
    return {"tps": statistics.median(rates), "runs": rates, "reported_tps": statistics.median(inner),
            "tokens": tokens}


@contextlib.contextmanager
def api_gateway(peers: Sequence[str], cpus: Sequence[int] = ()) -> Iterator[str]:
    """``meshnode api --peer ...`` on 127.0.0.1, port 0; yields its base URL."""
    cmd = [*taskset(cpus), sys.executable, "-m", "meshnode", "api", *[a for p in peers for a in ("--peer", p)],
           "--listen", "127.0.0.1:0"]
    state = tempfile.TemporaryDirectory(prefix="meshnode-api-")  # its initiator key: not the user's
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "XDG_STATE_HOME": state.name})
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"listening on (http://\S+/v1)", line)
            if m:
                yield m.group(1)
                return
        raise RuntimeError("meshnode api did not start")
    finally:
        proc.terminate()
        proc.wait(10)
        state.cleanup()


def api_decode(peers: Sequence[str], runs: int, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """Decode tok/s through the OpenAI API (official client, /v1/completions), by difference."""
    import openai

    with api_gateway(peers, cpus) as url, openai.OpenAI(base_url=url, api_key="unused") as client:
        model = client.models.list().data[0].id

        def one(n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            r = client.completions.create(model=model, prompt=PROMPT, max_tokens=n, temperature=0)
            assert r.usage is not None
            return time.perf_counter() - t0, r.usage.completion_tokens

        one(4)
        rates = []
        for _ in range(runs):
            (ts, ns), (tl, nl) = one(SHORT), one(LONG)
            rates.append((nl - ns) / (tl - ts))
    return {"tps": statistics.median(rates), "runs": rates}
