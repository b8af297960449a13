"""The chat page at ``/`` of the API, in headless Chromium (Playwright driving Debian's chromium) against a
real ``meshnode api`` process routing over real node processes.

A message typed and sent with Enter streams an answer onto the page that equals the API's non-streamed
answer to the very request the page sent; the route and its speed show beside it; the conversation is kept
(the next request carries it, a reload shows it); Stop ends the answer and frees the session on every hop;
with ``--api-key`` the page asks for the key; the model's output is sanitized markdown, never live HTML; the
page carries a Content-Security-Policy and breaks none of it; it fits 1280 and 390 px wide; its inputs are
labelled and reachable from the keyboard.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from meshnode.runtime.launch import NodeProcess
from meshnode.transport.client import health
from meshnode.web.assets import CSP
from tests.conftest import aio, until

#: a request SmolLM2 answers with an endless stream of one emoji (greedy): an answer that never ends by itself
ENDLESS = "Write a short markdown list of three fruits."
#: screenshots go to docs/ only when asked for (MESHNODE_SCREENSHOTS=1), so a test run leaves the tree clean
SHOTS = Path(__file__).parent.parent / "docs" if os.environ.get("MESHNODE_SCREENSHOTS") else None


def start_api(peers: Sequence[str], *extra: str) -> tuple[subprocess.Popen[str], str]:
    args = [a for p in peers for a in ("--peer", p)]
    proc = subprocess.Popen([sys.executable, "-m", "meshnode", "api", "--listen", "127.0.0.1:0", *args, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    m = re.search(r"listening on http://(\S+:\d+)/v1", proc.stdout.readline())
    if not m:
        proc.kill()
        raise AssertionError("the API did not start")
    return proc, f"http://{m.group(1)}"


@pytest.fixture
def api_url(route2: list[NodeProcess]) -> Iterator[str]:
    proc, url = start_api([n.endpoint for n in route2])
    yield url
    proc.terminate()
    proc.wait(15)
    assert proc.stdout is not None
    proc.stdout.close()


@pytest.fixture
def chromium() -> Iterator[Any]:
    """A headless Chromium (Debian's) under Playwright's sync API, in this test's thread."""
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "Debian's chromium is part of the test setup (.ci/install)"
    policy = asyncio.get_event_loop_policy()  # trio-asyncio's, once imported: it makes trio loops
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            yield browser
            browser.close()
    finally:
        asyncio.set_event_loop_policy(policy)


class Page:
    """One page of the chat, with what it logged: console errors and Content-Security-Policy violations."""

    def __init__(self, browser: Any, url: str, width: int = 1280) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": 820})
        self.page = self.context.new_page()
        self.console: list[str] = []
        self.sent: list[dict[str, Any]] = []
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("request", self._request)
        self.page.goto(url + "/")
        self.until("document.body.dataset.ready === '1'", "the page set itself up")

    def _request(self, request: Any) -> None:
        if request.url.endswith("/v1/chat/completions") and request.method == "POST":
            self.sent.append(json.loads(request.post_data))

    def js(self, expr: str) -> Any:
        return self.page.evaluate(expr)

    def until(self, expr: str, what: str, timeout: float = 60.0) -> Any:
        # the page's CSP forbids eval, which Playwright's wait_for_function needs: poll from here instead
        return until(lambda: self.js(expr), timeout, what, every=0.05)

    def answer_state(self, i: int = -1) -> str:
        return str(self.js(f"[...document.querySelectorAll('.msg.assistant')].at({i})?.dataset.state || ''"))

    def send(self, text: str) -> None:
        box = self.page.get_by_label("Message")
        box.fill(text)
        box.press("Enter")

    def violations(self) -> list[str]:
        return [m for m in self.console if "Content Security Policy" in m]


def whole_answer(url: str, request: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    """The API's non-streamed answer to ``request``, as the page sent it."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/chat/completions", json=request | {"stream": False}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def live_sessions(nodes: Sequence[NodeProcess]) -> list[int]:
    async def read() -> list[int]:
        return [(await aio(health, n.endpoint)).live_sessions for n in nodes]

    return trio.run(read)


def test_enter_streams_an_answer_equal_to_the_apis_own_and_the_conversation_is_kept(
        chromium: Any, api_url: str, route2: list[NodeProcess]) -> None:
    p = Page(chromium, api_url)
    p.until("document.body.dataset.models === '1'", "the model list filled from /v1/models")
    assert "layers" in p.page.get_by_label("Model").inner_text()
    p.page.get_by_label("Temperature").fill("0")
    p.page.get_by_label("Max tokens").fill("24")
    p.send("What is the capital of France?")
    p.until("document.querySelector('.msg.assistant')?.dataset.state === 'done'", "the answer finished")
    shown = p.js("window.meshnodeChat.messages.at(-1).content")
    assert int(p.js("document.querySelector('.msg.assistant').dataset.chunks")) > 1  # it came in pieces
    [request] = p.sent
    assert request["stream"] is True
    assert request["temperature"] == 0
    assert request["max_tokens"] == 24
    assert request["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    whole = whole_answer(api_url, request)
    assert shown == whole["choices"][0]["message"]["content"]
    assert p.page.locator(".msg.assistant .body").inner_text().strip()
    meta = p.page.locator(".msg.assistant .meta").inner_text()
    for hop, layers in zip(whole["meshnode"]["route"], ("[layers 0\u201314]", "[layers 15\u201329]"), strict=True):
        assert hop["node_id"][:8] in meta
        assert layers in meta
    assert re.search(r"\d+\.\d tok/s", meta), meta
    assert [h["endpoint"] for h in whole["meshnode"]["route"]] == [n.endpoint for n in route2]

    # a second turn carries the first, answer included; the answer equals the API's again
    p.send("And of Italy?")
    p.until("[...document.querySelectorAll('.msg.assistant')].at(-1)?.dataset.state === 'done'", "the 2nd answer")
    second = p.sent[1]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == shown
    assert p.js("window.meshnodeChat.messages.at(-1).content") == \
        whole_answer(api_url, second)["choices"][0]["message"]["content"]

    # the conversation survives a reload; New chat clears it
    p.page.reload()
    p.until("document.body.dataset.ready === '1'", "the page reloaded")
    assert p.page.locator(".msg").count() == 4
    p.page.get_by_role("button", name="New chat").click()
    assert p.page.locator(".msg").count() == 0
    p.page.reload()
    p.until("document.body.dataset.ready === '1'", "the page reloaded")
    assert p.page.locator(".msg").count() == 0
    assert p.violations() == []
    p.context.close()


def test_stop_ends_the_answer_and_frees_the_session_on_every_hop(chromium: Any, api_url: str,
                                                                route2: list[NodeProcess]) -> None:
    p = Page(chromium, api_url)
    p.until("document.body.dataset.models === '1'", "the model list")
    p.page.get_by_label("Temperature").fill("0")
    p.page.get_by_label("Max tokens").fill("4000")
    p.send(ENDLESS)
    p.until("Number(document.querySelector('.msg.assistant')?.dataset.chunks || 0) >= 5", "the answer streaming")
    assert live_sessions(route2) == [1, 1]
    assert p.page.get_by_role("button", name="Send").is_disabled()
    p.page.get_by_role("button", name="Stop").click()
    p.until("document.querySelector('.msg.assistant')?.dataset.state === 'stopped'", "the answer stopped")
    until(lambda: live_sessions(route2) == [0, 0], 30, "every hop freed the session")
    kept = p.js("window.meshnodeChat.messages.at(-1).content")
    assert 0 < len(kept) < 4000  # cut: what came before Stop is kept, far short of what was asked
    assert p.page.get_by_role("button", name="Stop").is_disabled()
    assert p.page.get_by_role("button", name="Send").is_enabled()
    # the route serves the next message
    p.page.get_by_label("Max tokens").fill("8")
    p.send("Hello")
    p.until("[...document.querySelectorAll('.msg.assistant')].at(-1)?.dataset.state === 'done'", "the next answer")
    p.context.close()


def test_with_an_api_key_the_page_asks_for_it(chromium: Any, route2: list[NodeProcess]) -> None:
    proc, url = start_api([n.endpoint for n in route2], "--api-key", "s3cret")
    try:
        p = Page(chromium, url)
        p.until("!document.getElementById('keyform').hidden", "the key form shown")
        key = p.page.get_by_label("API key")
        key.fill("wrong")
        key.press("Enter")
        p.until("document.getElementById('key-note').textContent.includes('refused')", "a wrong key refused")
        key.fill("s3cret")
        key.press("Enter")
        p.until("document.body.dataset.models === '1'", "the models, with the key")
        assert p.js("document.getElementById('keyform').hidden") is True
        p.page.get_by_label("Temperature").fill("0")
        p.page.get_by_label("Max tokens").fill("8")
        p.send("Hello")
        p.until("document.querySelector('.msg.assistant')?.dataset.state === 'done'", "an answer with the key")
        assert p.js("window.meshnodeChat.messages.at(-1).content") == \
            whole_answer(url, p.sent[0], "s3cret")["choices"][0]["message"]["content"]
        p.context.close()
    finally:
        proc.terminate()
        proc.wait(15)
        assert proc.stdout is not None
        proc.stdout.close()


HOSTILE = ("# Title\n\n**bold** and `code`\n\n<img src=x onerror=\"window.pwned='img'\">\n\n"
           "<script>window.pwned='script'</script>\n\n[link](javascript:window.pwned='link')\n\n"
           "<a href=\"javascript:window.pwned='a'\">a</a> <iframe src=\"/\"></iframe> "
           "<svg><script>window.pwned='svg'</script></svg> <form action=/x><button>b</button></form> "
           "<div onclick=\"window.pwned='div'\" style=\"position:fixed\">d</div>")


def test_model_output_is_sanitized_markdown_never_live_html(chromium: Any, api_url: str) -> None:
    """The answer's markdown renders (heading, bold, code) and nothing of its HTML runs or survives as
    script, handler, javascript: URL, frame or form -- rendered by the page's own code path."""
    p = Page(chromium, api_url)
    html = p.js(f"(() => {{ const d = document.createElement('div'); d.append(window.meshnodeChat.render("
                f"{json.dumps(HOSTILE)})); document.getElementById('log').append(d); return d.innerHTML; }})()")
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html
    assert "<code>code</code>" in html
    lowered = html.lower()
    for bad in ("<script", "onerror", "onclick", "javascript:", "<iframe", "<form", "<button"):
        assert bad not in lowered, (bad, html)
    for a in p.page.locator("#log a").all():  # click what links survived: none may run anything
        a.click(no_wait_after=True)
    assert p.js("window.pwned === undefined")
    # and the policy itself: an inline script put into the page by any means does not run
    p.js("(() => { const s = document.createElement('script'); s.textContent = \"window.pwned = 'inline'\"; "
         "document.body.append(s); })()")
    assert p.js("window.pwned === undefined")
    p.until("true", "a turn of the event loop")
    assert p.violations(), "the blocked inline script is reported as a CSP violation"
    p.context.close()


def test_the_page_and_its_assets_carry_the_policy(api_url: str) -> None:
    for path in ("/", "/assets/chat.js", "/assets/vendor/purify.min.js", "/v1/models", "/nope"):
        r = httpx.get(api_url + path, timeout=10)
        assert r.headers["content-security-policy"] == CSP, path
        assert r.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(api_url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<script>" not in page.text
    assert "style=" not in page.text
    assert "http://" not in page.text
    assert "https://" not in page.text
    assert httpx.get(api_url + "/assets/vendor/LICENSE.dompurify", timeout=10).status_code == 200
    for hostile in ("/assets/../app.py", "/assets/%2e%2e/assets.py", "/assets/vendor/", "/assets/" + "a" * 5000):
        assert httpx.get(api_url + hostile, timeout=10).status_code in (400, 404, 414, 431)
    assert httpx.get(api_url + "/healthz", timeout=10).status_code == 200  # it keeps serving


@pytest.mark.parametrize("width", [1280, 390])
def test_the_page_fits_its_width_and_works_from_the_keyboard(chromium: Any, api_url: str, width: int) -> None:
    p = Page(chromium, api_url, width)
    p.until("document.body.dataset.models === '1'", "the model list")
    for label in ("Message", "Model", "Temperature", "Max tokens"):
        assert p.page.get_by_label(label).count() == 1, label
    # Tab walks the controls in order, every one reachable
    p.page.locator("body").focus()
    seen = []
    for _ in range(12):
        p.page.keyboard.press("Tab")
        seen.append(p.js("document.activeElement.id || document.activeElement.textContent.trim()"))
    for control in ("model", "temperature", "max-tokens", "new-chat", "message", "send"):
        assert control in seen, (control, seen)
    # Shift+Enter adds a line, Enter sends (from the keyboard alone)
    p.page.get_by_label("Temperature").fill("0")
    p.page.get_by_label("Max tokens").fill("6")
    box = p.page.get_by_label("Message")
    box.focus()
    p.page.keyboard.type("Hello")
    p.page.keyboard.press("Shift+Enter")
    p.page.keyboard.type("there")
    assert box.input_value() == "Hello\nthere"
    p.page.keyboard.press("Enter")
    p.until("document.querySelector('.msg.assistant')?.dataset.state === 'done'", "the answer")
    assert p.sent[0]["messages"][0]["content"] == "Hello\nthere"
    assert p.js("document.documentElement.scrollWidth") <= width  # nothing sticks out sideways
    assert p.violations() == []
    if SHOTS is not None:
        (SHOTS / f"chat-{width}.png").write_bytes(p.page.screenshot())  # (a path= leaves an executor thread)
    p.context.close()


def test_the_page_is_served_by_a_node_with_api_too(chromium: Any, node_factory: Any) -> None:
    """``serve --api``: the same page at / of a node's API, answering through the mesh the node sees."""
    node_factory("0:15", extra=("--mdns", "127.0.0.1"))
    tail = node_factory("15:30", extra=("--mdns", "127.0.0.1", "--api", "127.0.0.1:0"))
    url = json.loads((tail.state_dir / "node.json").read_text())["api"].removesuffix("/v1")
    p = Page(chromium, url)
    p.until("document.body.dataset.models === '1'", "the node's API lists the model (mDNS finds the head)")
    p.page.get_by_label("Temperature").fill("0")
    p.page.get_by_label("Max tokens").fill("8")
    p.send("Hello")
    p.until("document.querySelector('.msg.assistant')?.dataset.state === 'done'", "an answer")
    assert p.js("window.meshnodeChat.messages.at(-1).content") == \
        whole_answer(url, p.sent[0])["choices"][0]["message"]["content"]
    assert p.violations() == []
    p.context.close()


def test_fuzz_the_pages_and_assets_from_outside(route2: list[NodeProcess]) -> None:
    """Random paths, methods and headers at / and /assets: never a 5xx, never a byte from outside
    meshnode/web/static, the policy on every answer; the API answers a real request afterwards."""
    from urllib.parse import quote

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from meshnode.web.assets import STATIC

    served = {f.read_bytes() for f in STATIC.rglob("*") if f.is_file()}
    segment = st.one_of(st.sampled_from(["..", ".", "%2e%2e", "%2f", "vendor", "chat.js", "LICENSE.uplot", "",
                                         "%00", "..%2f..%2fapp.py", "a" * 300]),
                        st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12).map(
                            lambda t: quote(t, safe="")))
    proc, url = start_api([n.endpoint for n in route2])
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(prefix=st.sampled_from(["/", "/assets/", "/assets/vendor/"]),
               parts=st.lists(segment, max_size=4),
               method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]),
               range_=st.one_of(st.none(), st.sampled_from(["bytes=0-10", "bytes=-5", "bytes=9999999-",
                                                            "bytes=5-1", "bytes=0-1,3-4,6-7", "items=1-2",
                                                            "bytes=" + "1-2," * 500])),
               etag=st.one_of(st.none(), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e),
                                                 max_size=40)))
        def one(prefix: str, parts: list[str], method: str, range_: str | None, etag: str | None) -> None:
            headers = {k: v for k, v in (("Range", range_), ("If-None-Match", etag)) if v is not None}
            conn = http.client.HTTPConnection(host, int(port), timeout=30)  # raw paths: no client-side cleanup
            try:
                conn.request(method, prefix + "/".join(parts), headers=headers)
                r = conn.getresponse()
                body = r.read()
            finally:
                conn.close()
            assert r.status < 500, (method, prefix, parts, r.status, body[:200])
            assert r.getheader("content-security-policy") == CSP
            if r.status == 200 and method == "GET" and "Range" not in headers and \
                    (r.getheader("content-type") or "").split(";")[0] != "application/json":
                assert body in served, (prefix, parts)

        one()
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"]  # still serving
    finally:
        proc.terminate()
        proc.wait(15)
        assert proc.stdout is not None
        proc.stdout.close()
