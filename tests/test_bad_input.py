"""Bad input gets a typed error, a clear message, a non-zero exit, and a node
that keeps serving its other sessions."""

from __future__ import annotations

import asyncio
import shutil
import socket
import uuid
from concurrent import futures

import grpc
import numpy as np
import pytest
import trio

from meshnode import errors
from meshnode.proto import node_pb2 as pb
from meshnode.proto import node_pb2_grpc as pb_grpc
from meshnode.session.initiator import GenerateConfig, check_route, generate
from meshnode.transport.client import open_channel
from meshnode.wire.schema import SCHEMA_VERSION
from meshnode.wire.tensors import encode_bundle
from tests.conftest import PROMPT, aio, cli, open_frame

# -- flags and files ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "code"),
    [("0:31", "LAYER_RANGE_INVALID"), ("5:5", "LAYER_RANGE_INVALID"), ("9:3", "LAYER_RANGE_INVALID"),
     ("a:b", "LAYER_RANGE_INVALID"), ("12", "LAYER_RANGE_INVALID")],
)
def test_serve_refuses_bad_layers(model, layers, code):
    proc = cli("serve", "--model", str(model), "--layers", layers)
    assert proc.returncode == 2
    assert f"meshnode: error: {code}" in proc.stderr
    assert "listening on" not in proc.stdout


def test_serve_refuses_bad_listen(model):
    proc = cli("serve", "--model", str(model), "--layers", "0:15", "--listen", "nohost")
    assert proc.returncode == 2
    assert "is not HOST:PORT" in proc.stderr


def test_serve_refuses_missing_truncated_and_non_gguf_files(model, tmp_path):
    missing = tmp_path / "nope.gguf"
    proc = cli("serve", "--model", str(missing), "--layers", "0:15")
    assert proc.returncode == 1
    assert "MODEL_NOT_FOUND" in proc.stderr

    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n" * 10)
    proc = cli("serve", "--model", str(text), "--layers", "0:15")
    assert proc.returncode == 1
    assert "MODEL_FORMAT" in proc.stderr
    assert "not a GGUF" in proc.stderr

    truncated = tmp_path / "truncated.gguf"
    with model.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(model.stat().st_size // 2))
    proc = cli("serve", "--model", str(truncated), "--layers", "0:15")
    assert proc.returncode == 1
    assert "truncated" in proc.stderr


def test_generate_refuses_bad_flags(model):
    proc = cli("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "0")
    assert proc.returncode == 2
    assert "--max-tokens" in proc.stderr
    proc = cli("generate", "--peer", "127.0.0.1:1", "--model", str(model), "--prompt", "hi")
    assert proc.returncode == 2


# -- peers -------------------------------------------------------------------------------


def test_generate_refuses_peers_out_of_layer_order(route2):
    head, tail = (n.endpoint for n in route2)
    proc = cli("generate", "--peer", tail, "--peer", head, "--prompt", PROMPT)
    assert proc.returncode == 2
    assert "ROUTE_INVALID" in proc.stderr
    proc = cli("generate", "--peer", head, "--prompt", PROMPT)
    assert proc.returncode == 2
    assert "layers 15-29 are not served" in proc.stderr


def test_a_grpc_server_that_is_not_a_meshnode(route2):
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # by default a node must speak TLS bound to its identity: a plaintext server is refused as such
        proc = cli("generate", "--peer", f"127.0.0.1:{port}", "--peer", route2[1].endpoint, "--prompt", PROMPT)
        assert proc.returncode == 1
        assert "TRANSPORT_INSECURE" in proc.stderr
        assert "--insecure" in proc.stderr
        assert f"127.0.0.1:{port}" in proc.stderr
        # a plaintext client reaches it, and finds it is not a meshnode
        proc = cli("generate", "--insecure", "--peer", f"127.0.0.1:{port}", "--prompt", PROMPT)
        assert proc.returncode == 1
        assert "NOT_A_MESHNODE" in proc.stderr
        assert f"127.0.0.1:{port}" in proc.stderr
    finally:
        server.stop(None)


def test_a_tcp_server_that_is_not_grpc(route2):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = cli("generate", "--peer", f"127.0.0.1:{port}", "--peer", route2[1].endpoint, "--prompt", PROMPT)
        assert proc.returncode == 1
        assert "TRANSPORT_INSECURE" in proc.stderr  # it accepts the connection and never answers the TLS hello
        plain = cli("generate", "--insecure", "--peer", f"127.0.0.1:{port}", "--peer", route2[1].endpoint,
                    "--prompt", PROMPT)
    assert plain.returncode == 1
    assert "PEER_UNAVAILABLE" in plain.stderr or "DEADLINE_EXCEEDED" in plain.stderr


async def test_a_peer_serving_another_model_is_refused(model, tmp_path, route2, node_factory):
    other = tmp_path / "other.gguf"
    shutil.copyfile(model, other)
    with other.open("ab") as fh:  # same tensors, another file: another fingerprint
        fh.write(b"\0" * 32)
    foreign_tail = await trio.to_thread.run_sync(lambda: node_factory("15:30", source=other))
    with pytest.raises(errors.RouteError, match="one model"):
        await aio(check_route, [route2[0].endpoint, foreign_tail.endpoint])


# -- corrupt frames, beside a healthy session ------------------------------------


def _open(sid: str, cap: pb.Capability) -> pb.SessionFrame:
    return open_frame(sid, cap)


def _step(sid: str, step_id: int, bundle: pb.TensorBundle, n_past: int = 0) -> pb.SessionFrame:
    return pb.SessionFrame(route_session_id=sid, route_epoch=1, step=pb.Step(
        step_id=step_id, activation=bundle, sample=True, cache=pb.CacheExpectation(n_past=n_past)))


async def _corrupt_then_valid(endpoint: str) -> list[str]:
    """Send bad bundles to a tail on one session; return the error codes, then prove it still works."""
    async with await open_channel(endpoint) as ch:
        stub = pb_grpc.NodeStub(ch)
        cap = await stub.GetCapability(pb.CapabilityRequest(schema_version=SCHEMA_VERSION))
        sid = str(uuid.uuid4())
        call = stub.Session()
        await call.write(_open(sid, cap))
        assert (await call.read()).HasField("accepted")
        x = np.random.default_rng(0).standard_normal((3, cap.n_embd)).astype(np.float32)
        bad: list[pb.TensorBundle] = []
        b = encode_bundle(x)
        b.checksum ^= 1
        bad.append(b)
        b = encode_bundle(x, max_chunk_bytes=1024)
        b.fragments[1].offset += 4
        bad.append(b)
        bad.append(encode_bundle(x[:, :100]))
        y = x.copy()
        y[1, 1] = np.nan
        bad.append(encode_bundle(y))
        b = encode_bundle(x)
        b.total_bytes += 4
        bad.append(b)
        codes = []
        for i, bundle in enumerate(bad, start=1):
            await call.write(_step(sid, i, bundle))
            reply = await call.read()
            assert reply.HasField("error")
            assert not reply.error.terminal
            assert reply.error.hop
            codes.append(pb.ErrorCode.Name(reply.error.code))
        # unknown cache state: a step that expects positions this hop does not hold
        await call.write(_step(sid, 10, encode_bundle(x, pos_start=7), n_past=7))
        reply = await call.read()
        codes.append(pb.ErrorCode.Name(reply.error.code))
        # the same session still computes a valid step
        await call.write(_step(sid, 11, encode_bundle(x)))
        reply = await call.read()
        assert reply.HasField("result"), reply
        assert 0 <= reply.result.token < 49152
        await call.write(pb.SessionFrame(route_session_id=sid, route_epoch=1, release=pb.ReleaseSignal()))
        assert (await call.read()).released
        await call.done_writing()
        return codes


async def test_corrupt_bundles_get_typed_errors_and_spare_other_sessions(route2, reference):
    peers = [n.endpoint for n in route2]
    healthy: list[object] = []

    async def run_both() -> list[str]:
        task = asyncio.ensure_future(generate(peers, GenerateConfig(prompt=PROMPT, max_tokens=32)))
        codes = await _corrupt_then_valid(peers[1])
        healthy.append(await task)
        return codes

    with trio.fail_after(120):
        codes = await aio(run_both)
    assert codes == ["CHECKSUM_MISMATCH", "FRAGMENT_TILING", "TENSOR_SHAPE", "TENSOR_SHAPE", "TENSOR_SHAPE",
                     "CACHE_MISS"]
    assert healthy[0].tokens == reference.tokens  # type: ignore[attr-defined]


async def test_steps_for_an_unknown_session_are_refused(route2):
    async def go() -> pb.SessionReply:
        async with await open_channel(route2[1].endpoint) as ch:
            call = pb_grpc.NodeStub(ch).Session()
            await call.write(_step("no-such-session", 1, encode_bundle(np.zeros((1, 576), np.float32))))
            reply = await call.read()
            call.cancel()
            return reply

    reply = await aio(go)
    assert pb.ErrorCode.Name(reply.error.code) == "UNKNOWN_SESSION"
    assert reply.error.terminal
