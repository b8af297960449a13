"""Prometheus metrics of a live node."""

from __future__ import annotations

import json
import re
import urllib.request

import trio

from meshnode.metrics import NodeMetrics
from meshnode.session.initiator import GenerateConfig, generate
from tests.conftest import PROMPT, aio


def test_exposition_format_names_and_totals():
    m = NodeMetrics(live_sessions=lambda: 3)
    m.tokens.labels(kind="prefill").inc(5)
    m.tokens.labels(kind="decode").inc()
    m.errors.labels(code="CHECKSUM_MISMATCH").inc()
    m.steps.observe(0.004)
    m.steps.observe(0.006)
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert "# TYPE meshnode_step_seconds histogram" in text
    assert 'meshnode_tokens_total{kind="prefill"} 5.0' in text
    assert 'meshnode_errors_total{code="CHECKSUM_MISMATCH"} 1.0' in text
    assert 'meshnode_step_seconds_bucket{le="0.005"} 1.0' in text
    assert 'meshnode_step_seconds_bucket{le="+Inf"} 2.0' in text
    assert "meshnode_sessions_open 3.0" in text  # read from the callback when rendered
    assert "meshnode_sessions_total 0.0" in text
    assert (m.tokens_total(), m.errors_total(), round(m.step_seconds_mean(), 6)) == (6, 1, 0.005)
    assert NodeMetrics().step_seconds_mean() == 0.0
    # each node has a registry of its own: a second one in this process neither clashes nor shares
    assert NodeMetrics().tokens_total() == 0


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    rows = re.finditer(r"^(\S+) (\S+)$", text, re.M)
    return {m.group(1): float(m.group(2)) for m in rows if not m.group(1).startswith("#")}


async def test_a_node_counts_sessions_tokens_latency_bytes_and_errors(node_factory, model):
    head = await trio.to_thread.run_sync(lambda: node_factory("0:15", extra=("--metrics", "127.0.0.1:0")))
    tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", extra=("--metrics", "127.0.0.1:0")))
    urls = [json.loads((n.state_dir / "node.json").read_text())["metrics"] for n in (head, tail)]
    before = [_scrape(u) for u in urls]
    result = await aio(generate, [head.endpoint, tail.endpoint], GenerateConfig(prompt=PROMPT, max_tokens=8))
    after = [_scrape(u) for u in urls]
    n_prompt = len(result.prompt_tokens)
    for b, a in zip(before, after, strict=True):
        assert a["meshnode_sessions_total"] - b.get("meshnode_sessions_total", 0) == 1
        assert a['meshnode_tokens_total{kind="prefill"}'] == n_prompt
        assert a['meshnode_tokens_total{kind="decode"}'] == 7
        assert a["meshnode_step_seconds_count"] == 8
        assert a["meshnode_bytes_in_total"] > 0
        assert a["meshnode_bytes_out_total"] > 0
        assert a["meshnode_sessions_open"] == 0
    # the tail received residuals: far more bytes than the head's token ids
    assert after[1]["meshnode_bytes_in_total"] > 5 * after[0]["meshnode_bytes_in_total"]
