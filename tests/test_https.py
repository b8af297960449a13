"""HTTPS for the tracker and the API (meshnode/http/tls.py): a self-signed certificate pinned by its
fingerprint, refused when another is presented; plain HTTP off loopback refused without --insecure.
Real tracker, node and API processes on loopback; the official ``openai`` client over HTTPS."""

from __future__ import annotations

import hashlib
import json
import re
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trio

from meshnode import errors
from meshnode.http.client import request
from meshnode.runtime.launch import NodeProcess
from tests.conftest import cli

PROMPT = "The three primary colors are"


class Tracker:
    def __init__(self, proc: subprocess.Popen[str], line: str) -> None:
        self.proc = proc
        m = re.search(r"status page (https://\S+?)/ .*sha256=([0-9a-f]{64})", line)
        assert m, line
        self.url, self.fingerprint = m.group(1), m.group(2)

    @property
    def pinned(self) -> str:
        return f"{self.url}#sha256={self.fingerprint}"


@pytest.fixture
def tls_tracker(tmp_path: Path) -> Iterator[Tracker]:
    proc = subprocess.Popen([sys.executable, "-m", "tracker", "--listen", "127.0.0.1:0", "--db",
                             str(tmp_path / "t.sqlite"), "--ttl", "10", "--tls"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    try:
        yield Tracker(proc, line)
    finally:
        proc.terminate()
        proc.wait(15)
        proc.stdout.close()


async def _nodes(url: str) -> list[str]:
    status, body = await request(url.rstrip("/") + "/api/status")
    assert status == 200
    return [n["node_id"] for n in json.loads(body)["nodes"]]


async def test_a_tls_tracker_is_reached_by_its_pin_and_refused_by_any_other(tls_tracker, node_factory, tmp_path):
    t = tls_tracker
    # the certificate it keeps beside its database is the one it presents, and the one it printed
    der = ssl.PEM_cert_to_DER_cert((tmp_path / "tracker-tls.crt").read_text())
    assert hashlib.sha256(der).hexdigest() == t.fingerprint
    assert (tmp_path / "tracker-tls.key").stat().st_mode & 0o777 == 0o600

    node: NodeProcess = await trio.to_thread.run_sync(
        lambda: node_factory("0:30", extra=("--tracker", t.pinned, "--heartbeat", "1")))
    with trio.fail_after(60):
        while True:  # the node registers over the pinned HTTPS
            status, body = await request(f"{t.url}/api/status#sha256={t.fingerprint}")
            assert status == 200
            if json.loads(body)["nodes"]:
                break
            await trio.sleep(0.5)
    # a generation that finds its route on the tracker, over the pinned HTTPS
    proc = await trio.to_thread.run_sync(lambda: cli(
        "generate", "--mesh", "SmolLM2-135M-Instruct", "--tracker", t.pinned, "--prompt", PROMPT,
        "--max-tokens", "4", "--json"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["route"] == [node.endpoint]

    wrong = "0" * 64
    with pytest.raises(errors.ImpostorError, match=t.fingerprint):
        await request(f"{t.url}/api/status#sha256={wrong}")
    with pytest.raises(errors.PeerError, match=r"did not verify.*#sha256="):
        await request(f"{t.url}/api/status")  # no pin: the system's CAs do not know a self-signed certificate
    with pytest.raises(errors.PeerError):
        await request(t.url.replace("https://", "http://") + "/api/status")  # plain HTTP to an HTTPS port
    bad = cli("generate", "--mesh", "SmolLM2-135M-Instruct", "--tracker", f"{t.url}#sha256=abc",
              "--prompt", PROMPT)
    assert bad.returncode == 2
    assert "#sha256=" in bad.stderr


def test_plain_http_off_loopback_is_refused_without_insecure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tracker", "--listen", "0.0.0.0:0", "--db",
                           str(tmp_path / "t.sqlite")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--tls" in proc.stderr
    assert "--insecure" in proc.stderr
    api = cli("api", "--peer", "127.0.0.1:1", "--listen", "0.0.0.0:0", "--api-key", "k", timeout=60)
    assert api.returncode == 2
    assert "--tls" in api.stderr


def test_the_api_over_https_with_the_official_client(route2, tmp_path):
    state = tempfile.TemporaryDirectory(prefix="meshnode-api-")
    peers = [a for n in route2 for a in ("--peer", n.endpoint)]
    proc = subprocess.Popen([sys.executable, "-m", "meshnode", "api", *peers, "--listen", "127.0.0.1:0", "--tls"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**__import__("os").environ, "XDG_STATE_HOME": state.name})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on (https://(\S+):(\d+)/v1) \(certificate sha256=([0-9a-f]{64})\)", line)
        assert m, line
        base, host, port, fp = m.group(1), m.group(2), int(m.group(3)), m.group(4)
        pem = ssl.get_server_certificate((host, port))
        assert hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest() == fp  # what it printed
        (tmp_path / "api.crt").write_text(pem)
        ctx = ssl.create_default_context(cafile=str(tmp_path / "api.crt"))  # it names 127.0.0.1 itself
        with httpx.Client(verify=ctx) as http, openai.OpenAI(base_url=base, api_key="unused", http_client=http,
                                                              max_retries=0, timeout=120) as client:
            out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                            temperature=0)
        direct = cli("generate", *peers, "--prompt", PROMPT, "--max-tokens", "8", "--json")
        assert direct.returncode == 0, direct.stderr
        assert out.choices[0].text == json.loads(direct.stdout)["text"]
        with pytest.raises(httpx.ConnectError):  # the system's CAs do not know it
            httpx.get(base + "/models", timeout=10)
    finally:
        proc.terminate()
        proc.wait(15)
        if proc.stdout is not None:
            proc.stdout.close()
        state.cleanup()


def test_a_nodes_own_api_over_https(node_factory, tmp_path):
    node = node_factory("0:30", extra=("--api", "127.0.0.1:0", "--api-tls"))
    assert node.state_dir is not None
    info = json.loads((node.state_dir / "node.json").read_text())
    base = info["api"]
    assert base.startswith("https://127.0.0.1:")
    cert = node.state_dir / "api-tls.crt"
    assert (node.state_dir / "api-tls.key").stat().st_mode & 0o777 == 0o600
    ctx = ssl.create_default_context(cafile=str(cert))  # it names 127.0.0.1 itself
    with httpx.Client(verify=ctx) as http, openai.OpenAI(base_url=base, api_key="unused", http_client=http,
                                                          max_retries=0, timeout=120) as client:
        out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0)
    direct = cli("generate", "--peer", node.endpoint, "--prompt", PROMPT, "--max-tokens", "4", "--json")
    assert direct.returncode == 0, direct.stderr
    assert out.choices[0].text == json.loads(direct.stdout)["text"]
    # off loopback: HTTPS (or --insecure) and a key, or the node does not start
    bad = cli("serve", "--layers", "0:30", "--api", "0.0.0.0:0", "--api-key", "k", "--state-dir", str(tmp_path),
              timeout=120)
    assert bad.returncode == 2
    assert "--api-tls" in bad.stderr
