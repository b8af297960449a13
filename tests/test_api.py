"""The OpenAI-compatible API, driven by the official ``openai`` client against a real ``meshnode api``
process routing over real node processes. Every answer is compared with llama-cpp-python's ``Llama``
running the whole model with the same request (completion, chat, greedy and seeded sampling, stop
strings), streamed or not; errors come back as OpenAI error bodies with their HTTP codes; a streaming
client that goes away frees the session on every hop."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import openai
import pytest
import trio

from meshnode.runtime.launch import NodeProcess
from meshnode.transport.client import health
from tests.conftest import aio

PROMPT = "The three primary colors are"
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a fruit that is red."}]


@dataclass
class Api:
    proc: subprocess.Popen[str]
    addr: str
    log: Any
    #: one openai client per key, closed with the API process
    clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.addr}/v1"

    def client(self, key: str = "unused") -> openai.OpenAI:
        if key not in self.clients:
            self.clients[key] = openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)
        return self.clients[key]

    def stderr(self) -> str:
        self.log.seek(0)
        return str(self.log.read())


@pytest.fixture
def api_factory() -> Iterator[Any]:
    started: list[Api] = []

    def make(peers: Sequence[str], *extra: str) -> Api:
        log = tempfile.TemporaryFile(mode="w+")
        args = [a for p in peers for a in ("--peer", p)]
        proc = subprocess.Popen([sys.executable, "-m", "meshnode", "api", "--listen", "127.0.0.1:0", *args, *extra],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on http://(\S+:\d+)/v1", line)
        if not m:
            proc.kill()
            log.seek(0)
            raise AssertionError(f"the API did not start: {line!r} {log.read()[-800:]}")
        api = Api(proc, m.group(1), log)
        started.append(api)
        return api

    yield make
    for a in started:
        for c in a.clients.values():
            c.close()
        a.proc.terminate()
        a.proc.wait(15)
        assert a.proc.stdout is not None
        a.proc.stdout.close()
        a.log.close()


@pytest.fixture(scope="module")
def whole(model: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(model), verbose=False)  # the default context settings, as the route's
    yield llm
    llm.close()


@pytest.fixture
def api(api_factory: Any, route2: list[NodeProcess]) -> Api:
    return api_factory([n.endpoint for n in route2])


def test_models_lists_the_covered_model_by_name_and_fingerprint(api: Api, route2: list[NodeProcess]) -> None:
    models = api.client().models.list().data
    assert len(models) == 1
    assert models[0].id == "SmolLM2-135M-Instruct.Q4_1"  # the file name, as `model pull` shows it
    assert models[0].model_extra["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert re.fullmatch(r"[0-9a-f]{64}", models[0].model_extra["fingerprint"])


@pytest.mark.parametrize("params", [
    {"temperature": 0},
    {"temperature": 0.8, "seed": 7},
    {"temperature": 1.1, "seed": 1234, "top_k": 20, "top_p": 0.9, "repeat_penalty": 1.3, "presence_penalty": 0.4},
    {"temperature": 0, "stop": [" and"]},
])
def test_completion_equals_llama(api: Api, whole: llama_cpp.Llama, params: dict[str, Any]) -> None:
    extra = {k: params[k] for k in ("top_k", "repeat_penalty") if k in params}
    std = {k: v for k, v in params.items() if k not in extra}
    got = api.client().completions.create(model="smollm2 135m 8k lc100k mix1 ep2", prompt=PROMPT, max_tokens=24,
                                          extra_body=extra, **std)
    want = whole.create_completion(PROMPT, max_tokens=24, **params)
    assert got.choices[0].text == want["choices"][0]["text"]
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.7, "seed": 3}])
def test_chat_equals_llama(api: Api, whole: llama_cpp.Llama, params: dict[str, Any]) -> None:
    fp = api.client().models.list().data[0].model_extra["fingerprint"]
    got = api.client().chat.completions.create(model=fp[:10].upper(), messages=CHAT, max_tokens=32, **params)
    want = whole.create_chat_completion(CHAT, max_tokens=32, **params)  # type: ignore[arg-type]
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]  # type: ignore[index]
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]  # type: ignore[index]


def test_defaults_are_llamas(api: Api, whole: llama_cpp.Llama) -> None:
    """No sampling fields at all: Llama's own defaults (completion: temperature 0.8, top_k 40, ...;
    chat: temperature 0.2), the same seed given to both."""
    c = api.client()
    model = c.models.list().data[0].id
    got = c.completions.create(model=model, prompt=PROMPT, max_tokens=20, seed=11)
    want = whole.create_completion(PROMPT, max_tokens=20, seed=11)
    assert got.choices[0].text == want["choices"][0]["text"]
    chat = c.chat.completions.create(model=model, messages=CHAT, max_tokens=20, seed=11)
    want_chat = whole.create_chat_completion(CHAT, max_tokens=20, seed=11)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == want_chat["choices"][0]["message"]["content"]  # type: ignore[index]


def test_streamed_answers_are_the_whole_answers(api: Api) -> None:
    c = api.client()
    model = c.models.list().data[0].id
    whole_text = c.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole_text
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    chat_whole = c.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    stream = list(c.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat_whole.choices[0].message.content
    assert stream[-1].usage is not None
    assert stream[-1].usage.completion_tokens == chat_whole.usage.completion_tokens  # type: ignore[union-attr]
    # on the wire: server-sent events ending in [DONE]
    raw = httpx.post(api.base_url + "/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 3,
                                                          "stream": True, "temperature": 0}, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_unseeded_sampling_reports_its_seed_and_repeats(api: Api) -> None:
    c = api.client()
    model = c.models.list().data[0].id
    first = c.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0)
    seed = first.model_extra["seed"]
    again = c.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed)
    assert again.choices[0].text == first.choices[0].text


def test_errors_are_openai_errors_with_fitting_codes(api: Api, api_factory: Any, route2: list[NodeProcess]) -> None:
    c = api.client()
    model = c.models.list().data[0].id
    with pytest.raises(openai.NotFoundError, match="known models: Smollm2 135M"):
        c.completions.create(model="no-such-model", prompt="x")
    for bad in ({"temperature": -1}, {"max_tokens": 0}, {"top_p": 2.0}, {"stop": [1, 2]}, {"n": 2}):
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=model, prompt="x", **bad)  # type: ignore[arg-type]
        assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model=model, messages=[])
    r = httpx.post(api.base_url + "/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(api.base_url + "/completions", content=b"x" * (2 * 1024 * 1024), timeout=10)
    assert r.status_code == 413
    # a gateway that knows only the head: the model is known, no route covers it
    half = api_factory([route2[0].endpoint])
    with pytest.raises(openai.APIStatusError) as info:
        half.client().completions.create(model=model, prompt="x")
    assert info.value.status_code == 503


def test_api_key_is_required_when_set_and_off_loopback(api_factory: Any, route2: list[NodeProcess]) -> None:
    keyed = api_factory([n.endpoint for n in route2], "--api-key", "s3cret")
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong").models.list()
    assert keyed.client("s3cret").models.list().data
    proc = subprocess.run([sys.executable, "-m", "meshnode", "api", "--listen", "0.0.0.0:0", "--peer",
                           route2[0].endpoint], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "--api-key" in proc.stderr


def test_concurrent_requests_each_get_their_own_answer(api: Api) -> None:
    import concurrent.futures

    c = api.client()
    model = c.models.list().data[0].id
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,", "def fib(n):"]
    solo = [c.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
            for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: c.completions.create(model=model, prompt=p, max_tokens=16,
                                                                temperature=0).choices[0].text, prompts))
    assert together == solo


async def test_a_client_that_goes_away_frees_every_hop(api_factory: Any, node_factory: Any) -> None:
    """A stream cut after a few chunks: each hop's live sessions drop to 0 long before the answer could
    have ended (it asked for 4000 tokens), and the route serves the next request."""
    nodes = [node_factory("0:15"), node_factory("15:30")]
    api = api_factory([n.endpoint for n in nodes])
    body = json.dumps({"model": "smollm2 135m 8k lc100k mix1 ep2", "prompt": PROMPT, "max_tokens": 4000,
                       "temperature": 0, "stream": True}).encode()
    host, port = api.addr.rsplit(":", 1)
    with trio.fail_after(120):
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while seen.count(b"data: ") < 5:
            seen += await stream.receive_some(65536)
        live = [(await aio(health, n.endpoint)).live_sessions for n in nodes]
        assert live == [1, 1]
        await stream.aclose()  # the client goes away mid-answer
        t0 = time.monotonic()
        while [(await aio(health, n.endpoint)).live_sessions for n in nodes] != [0, 0]:  # noqa: ASYNC110
            await trio.sleep(0.02)  # polling another process's state: there is no event to wait on
        freed_after = time.monotonic() - t0
        tokens = (await aio(health, nodes[1].endpoint)).tokens_total
    print(f"hops freed {freed_after:.3f} s after the client went away")
    assert tokens < 2000  # cut, not finished: 4000 tokens were asked for
    text = api.client().completions.create(model="smollm2 135m 8k lc100k mix1 ep2", prompt=PROMPT, max_tokens=8,
                                           temperature=0).choices[0].text
    assert text


def test_the_port_is_refused_cleanly_when_busy(route2: list[NodeProcess]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "meshnode", "api", "--listen", f"127.0.0.1:{port}", "--peer",
                               route2[0].endpoint], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cannot listen" in proc.stderr
    assert "Traceback" not in proc.stderr


async def test_a_node_serves_the_api_over_the_mesh_it_sees(node_factory: Any, whole: llama_cpp.Llama) -> None:
    """``serve --api``: the tail finds the head over mDNS (loopback) and answers as the whole model does."""
    node_factory("0:15", extra=("--mdns", "127.0.0.1"))
    tail = node_factory("15:30", extra=("--mdns", "127.0.0.1", "--api", "127.0.0.1:0"))
    url = json.loads((tail.state_dir / "node.json").read_text())["api"]
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c, trio.fail_after(30):
        while not c.models.list().data:  # noqa: ASYNC110 (mDNS finds the head within a second or so)
            await trio.sleep(0.2)
        got = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == whole.create_completion(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]


async def test_no_free_session_is_429_and_a_slow_request_is_504(api_factory: Any, node_factory: Any) -> None:
    """One session per hop: while a long stream holds it, another request gets 429; a request that
    outlives --request-timeout gets 504 (and its session is released)."""
    nodes = [node_factory("0:15", extra=("--max-sessions", "1")), node_factory("15:30", extra=("--max-sessions", "1"))]
    api = api_factory([n.endpoint for n in nodes])
    model = "SmolLM2-135M-Instruct"
    with api.client().completions.create(model=model, prompt=PROMPT, max_tokens=3000, temperature=0,
                                         stream=True) as stream:
        next(iter(stream))  # the session is open on both hops
        with pytest.raises(openai.RateLimitError) as info:
            api.client().completions.create(model=model, prompt=PROMPT, max_tokens=4)
        assert info.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    with trio.fail_after(30):
        while [(await aio(health, n.endpoint)).live_sessions for n in nodes] != [0, 0]:  # noqa: ASYNC110
            await trio.sleep(0.05)
    hurried = api_factory([n.endpoint for n in nodes], "--request-timeout", "3")
    with pytest.raises(openai.APIStatusError) as slow:
        # counting, greedy: no end-of-generation before 3000 tokens, so it outlives 3 s on any host
        hurried.client().completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=3000, temperature=0)
    assert slow.value.status_code == 504
    with trio.fail_after(30):
        while [(await aio(health, n.endpoint)).live_sessions for n in nodes] != [0, 0]:  # noqa: ASYNC110
            await trio.sleep(0.05)


@pytest.mark.parametrize("params", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}])
def test_drafting_through_the_api_is_the_same_text(api_factory: Any, route2: list[NodeProcess],
                                                   whole: llama_cpp.Llama, params: dict[str, Any]) -> None:
    """Speculative decoding as the server's default (``meshnode api --draft ngram``) and per request
    (``draft``): the answer is ``create_completion``'s, drafted or not; bad values are 400s."""
    prompt = ("Copy this text exactly.\nText: The quick brown fox jumps over the lazy dog near the river bank.\n"
              "Copy: The quick brown fox")
    want = whole.create_completion(prompt, max_tokens=32, **params)["choices"][0]["text"]
    drafting = api_factory([n.endpoint for n in route2], "--draft", "ngram")
    plain = api_factory([n.endpoint for n in route2])
    for a, body, drafted in ((drafting, {}, True), (drafting, {"draft": "none"}, False),
                             (plain, {"draft": "ngram", "draft_max": 4}, True), (plain, {}, False)):
        got = a.client().completions.create(model="smollm2 135m 8k lc100k mix1 ep2", prompt=prompt, max_tokens=32,
                                            extra_body=body, **params)
        assert got.choices[0].text == want
        stats = (got.model_extra or {}).get("draft")
        assert (stats is not None and stats["steps"] > 0) == drafted
    for bad in ({"draft": "magic"}, {"draft": 3}, {"draft_max": 0}, {"draft_max": 65}):
        with pytest.raises(openai.BadRequestError, match="draft"):
            plain.client().completions.create(model="smollm2 135m 8k lc100k mix1 ep2", prompt=prompt, max_tokens=4,
                                              extra_body=bad)
