"""Joining with no copy of the model (meshnode/fetch): a node fetches its range's bytes from the peers
that serve the model, every piece checked against the model id, resumable, paced; peers serve the
bytes over their gRPC port (Fetch), bounded, and hostile requests get typed refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from meshnode import errors
from meshnode.fetch.limits import Admission, Pacer, ShareLimits
from meshnode.fetch.plan import Piece, all_pieces, assign, pieces
from meshnode.fetch.share import MAX_SPANS, check_request
from meshnode.gguf import ensure_range
from meshnode.gguf.meta import read_meta
from meshnode.gguf.model import fingerprint
from meshnode.gguf.slicer import source_reads
from meshnode.modelid import manifest_of
from meshnode.proto import node_pb2 as pb
from meshnode.runtime.launch import NodeProcess, start_node
from meshnode.transport import client
from meshnode.transport.aiothread import open_aio_thread
from tests.conftest import PROMPT, cli
from tests.test_tracker import _start_tracker, _stop

SHARE_RATE = "6"  # MiB/s per holder: a head's ~60 MB takes seconds, time enough to kill a fetch midway


# -- pure decisions ---------------------------------------------------------------------------------


def test_a_range_fetches_the_tensors_its_cut_reads_and_no_others(model: Path) -> None:
    meta = read_meta(model)
    m = manifest_of(model)
    head, middle, tail = (source_reads(meta, *r) for r in ((0, 10), (10, 20), (20, 30)))
    assert "token_embd.weight" in head
    assert "blk.9.attn_q.weight" in head
    assert "blk.10.attn_q.weight" not in head
    assert "token_embd.weight" not in middle
    assert "output_norm.weight" in middle
    assert "token_embd.weight" in tail  # SmolLM2 is tied: its lm_head is token_embd
    want = pieces(m, head)
    assert want[0].what == "header"
    assert sum(p.length for p in want) < 0.6 * m.size


def test_pieces_are_dealt_among_their_holders() -> None:
    ps = [Piece(i * 10, 10, "0" * 64, f"p{i}") for i in range(6)]
    got = assign(ps, {"a": None, "b": None})
    assert sorted(p.offset for v in got.values() for p in v) == [p.offset for p in ps]
    assert len(got["a"]) == len(got["b"]) == 3
    only = assign(ps, {"a": None, "b": ps[:2]})  # b holds two pieces
    assert {p.offset for p in only.get("b", [])} <= {0, 10}
    assert assign(ps, {"b": ps[:2]}) == {"b": ps[:2]}  # what nobody holds is left out


def test_pace_and_admission() -> None:
    p = Pacer(rate=100.0, burst=50.0)
    assert p.delay(50, now=10.0) == 0.0
    assert p.delay(100, now=10.0) == pytest.approx(1.0)  # 100 bytes owed at 100/s
    assert p.delay(10, now=12.0) == 0.0
    a = Admission(ShareLimits(per_requester=1, total=2))
    a.enter("x")
    with pytest.raises(errors.FetchBusyError, match="x has 1"):
        a.enter("x")
    a.enter("y")
    with pytest.raises(errors.FetchBusyError, match="2 fetches"):
        a.enter("z")
    a.leave("x")
    a.enter("z")


def test_requests_are_checked_whole(model: Path) -> None:
    m = manifest_of(model)
    held = {p.offset: p for p in all_pieces(m)}
    one = all_pieces(m)[3]
    ok = pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan(offset=one.offset, length=one.length)])
    assert check_request(m, m.model_id, ok, held) == [one]
    bad = [
        (pb.FetchRequest(model_id="zz"), errors.InputError),
        (pb.FetchRequest(model_id="0" * 64, manifest=True), errors.ModelNotFoundError),
        (pb.FetchRequest(model_id=m.model_id), errors.InputError),  # nothing asked
        (pb.FetchRequest(model_id=m.model_id, manifest=True, spans=ok.spans), errors.InputError),
        (pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan(offset=one.offset + 1, length=one.length)]),
         errors.InputError),
        (pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan(offset=one.offset, length=1 << 40)]),
         errors.InputError),
        (pb.FetchRequest(model_id=m.model_id, spans=[ok.spans[0]] * (MAX_SPANS + 1)), errors.InputError),
    ]
    for req, kind in bad:
        with pytest.raises(kind):
            check_request(m, m.model_id, req, held)
    with pytest.raises(errors.ModelNotFoundError, match="does not hold"):
        check_request(m, m.model_id, ok, {})  # a node that fetched only another range


# -- real nodes -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tracker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = _start_tracker(tmp_path_factory.mktemp("tracker") / "t.sqlite", ttl=10)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def holders(model: Path, tracker: str) -> Iterator[list[NodeProcess]]:
    """Two nodes of the whole file (the halves), on the tracker, serving its bytes at SHARE_RATE."""
    nodes = [start_node(model, layers, command="join",
                        extra=("--tracker", tracker, "--heartbeat", "1", "--share-rate", SHARE_RATE,
                               "--metrics", "127.0.0.1:0"))
             for layers in ("0:15", "15:30")]
    yield nodes
    for n in nodes:
        n.stop()


def _join_fetching(tracker: str, model: Path, cache: Path, layers: str = "0:15", **env: str) -> NodeProcess:
    return start_node(None, layers, command="join", timeout=180,
                      extra=("--mesh", fingerprint(model)[:16], "--tracker", tracker, "--heartbeat", "1"),
                      env={"MESHNODE_CACHE_DIR": str(cache), **env})


def _generate(peers: list[str], n: int = 24) -> dict:
    done = cli("generate", *[a for p in peers for a in ("--peer", p)], "--prompt", PROMPT, "--max-tokens", str(n),
               "--temperature", "0", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_node_with_no_copy_fetches_its_range_from_several_peers_and_serves_it(
        model: Path, tracker: str, holders: list[NodeProcess], reference, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    node = _join_fetching(tracker, model, cache)
    try:
        log = node.stderr()
        assert "fetched" in log, log
        for h in holders:  # both sent pieces
            assert h.endpoint in log.split("fetched", 1)[1].splitlines()[0]
        got = _generate([node.endpoint, holders[1].endpoint])
        assert got["tokens"] == reference.tokens[: len(got["tokens"])]
        mid = fingerprint(model)
        fetched = cache / "fetched" / mid / "model.gguf"
        assert fetched.stat().st_size == model.stat().st_size
        assert fetched.stat().st_blocks * 512 < 0.7 * model.stat().st_size  # sparse: the tail's layers never came
        # the range cut from the fetched file is the one cut from the whole file, tensor for tensor
        cut = next((cache / "ranges").glob("*/0-15.*/manifest.json"))
        assert json.loads(cut.read_text())["range_digest"] == ensure_range(model, 0, 15).range_digest
        # and it serves what it holds to the next node that fetches (a range inside its own)
        again = _join_fetching(tracker, model, tmp_path / "cache2", layers="0:10")
        try:
            assert node.endpoint in again.stderr().split("fetched", 1)[1].splitlines()[0]
        finally:
            again.stop()
    finally:
        node.stop()


def test_a_peer_that_sends_wrong_bytes_is_dropped_and_named(model: Path, tracker: str, holders: list[NodeProcess],
                                                           reference, tmp_path: Path) -> None:
    liar = start_node(model, "0:15", command="join", extra=("--tracker", tracker, "--heartbeat", "1"),
                      env={"MESHNODE_TEST_FETCH_LIE": "1"})
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the tracker lists it
            with urllib.request.urlopen(f"{tracker}/api/lookup?model={fingerprint(model)}", timeout=5) as r:
                if liar.endpoint in r.read().decode():
                    break
            time.sleep(0.3)
        node = _join_fetching(tracker, model, tmp_path / "cache")
        try:
            log = node.stderr()
            assert f"dropped {liar.endpoint}" in log, log
            assert "not the manifest" in log or "is not the manifest's" in log
            got = _generate([node.endpoint, holders[1].endpoint])
            assert got["tokens"] == reference.tokens[: len(got["tokens"])]
        finally:
            node.stop()
    finally:
        liar.stop()


def test_a_killed_fetch_resumes_where_it_stopped(model: Path, tracker: str, holders: list[NodeProcess],
                                                reference, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    listed = cache / "fetched" / fingerprint(model) / "pieces.json"
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "meshnode", "join", "--mesh", fingerprint(model)[:16], "--tracker", tracker,
           "--layers", "0:15", "--listen", "127.0.0.1:0", "--state-dir", str(state)]
    env = {**os.environ, "MESHNODE_CACHE_DIR": str(cache)}
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        had: list[int] = []
        while time.monotonic() < deadline and len(had) < 4:
            try:
                had = json.loads(listed.read_text())
            except (OSError, ValueError):
                had = []
            time.sleep(0.05)
        assert len(had) >= 4, "the fetch never got going"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    node = _join_fetching(tracker, model, cache)
    try:
        log = node.stderr()
        m = manifest_of(model)
        need = pieces(m, source_reads(read_meta(model), 0, 15))
        fetched_now = int(log.split("in ", 1)[1].split(" checked pieces")[0]) if " checked pieces" in log else -1
        assert 0 < fetched_now <= len(need) - len(had) + 1, log  # what was listed was not fetched again
        got = _generate([node.endpoint, holders[1].endpoint])
        assert got["tokens"] == reference.tokens[: len(got["tokens"])]
    finally:
        node.stop()


def _fetch_all(endpoint: str, req: pb.FetchRequest) -> list[pb.FetchChunk]:
    async def main() -> list[pb.FetchChunk]:
        async with open_aio_thread() as aio:
            async def go() -> list[pb.FetchChunk]:
                return [c async for c in client.fetch(endpoint, req, timeout=60)]

            return await aio.run(go)

    return trio.run(main)


def _metrics(node: NodeProcess) -> str:
    assert node.state_dir is not None
    url = json.loads((node.state_dir / "node.json").read_text())["metrics"]
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_fetch_rpc_refuses_hostile_requests_with_typed_errors_and_keeps_serving(
        model: Path, holders: list[NodeProcess], reference) -> None:
    h = holders[0]
    m = manifest_of(model)
    raw = b"".join(c.data for c in _fetch_all(h.endpoint, pb.FetchRequest(model_id=m.model_id, manifest=True)))
    assert raw == m.canonical()
    one = all_pieces(m)[1]
    data = b"".join(c.data for c in _fetch_all(h.endpoint, pb.FetchRequest(
        model_id=m.model_id, spans=[pb.ByteSpan(offset=one.offset, length=one.length)])))
    assert data == model.read_bytes()[one.offset : one.offset + one.length]
    hostile = [
        (pb.FetchRequest(model_id="not hex"), errors.InputError),
        (pb.FetchRequest(model_id="f" * 64, manifest=True), errors.ModelNotFoundError),
        (pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan(offset=3, length=5)]), errors.InputError),
        (pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan(offset=2**63, length=2**63)]), errors.InputError),
        (pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan()] * (MAX_SPANS + 1)), errors.InputError),
    ]
    for req, kind in hostile:
        with pytest.raises(kind):
            _fetch_all(h.endpoint, req)
    # bytes that are no FetchRequest at all
    done = subprocess.run([sys.executable, "-c", f"""
import grpc
ch = grpc.insecure_channel("{h.endpoint}")
call = ch.unary_stream("/meshnode.v1.Node/Fetch", request_serializer=None, response_deserializer=None)
try:
    list(call(b"\\xff\\x01garbage" * 50, timeout=10))
except grpc.RpcError as e:
    print(e.code())
"""], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip(), done.stderr  # refused (plaintext to a TLS node, or undecodable): not served
    # a requester with more fetches than it may run at once
    big = pb.FetchRequest(model_id=m.model_id, spans=[pb.ByteSpan(offset=p.offset, length=p.length)
                                                      for p in all_pieces(m)[1:12]])

    async def crowd() -> list[str]:
        async with open_aio_thread() as aio:
            async def one() -> str:
                try:
                    async for _ in client.fetch(h.endpoint, big, timeout=60):
                        pass
                except errors.FetchBusyError:
                    return "busy"
                return "done"

            out: list[str] = []
            async with trio.open_nursery() as nursery:
                async def run() -> None:
                    out.append(await aio.run(one))

                for _ in range(4):
                    nursery.start_soon(run)
            return out

    outcomes = trio.run(crowd)
    assert outcomes.count("busy") >= 1
    assert outcomes.count("done") >= 1
    text = _metrics(h)
    assert 'meshnode_fetch_refused_total{code="FETCH_BUSY"}' in text
    assert 'meshnode_fetch_refused_total{code="INVALID_ARGUMENT"}' in text
    served = float(next(line.split()[-1] for line in text.splitlines()
                        if line.startswith("meshnode_fetch_bytes_served_total ")))
    assert served >= one.length
    got = _generate([h.endpoint, holders[1].endpoint])  # and it still serves sessions
    assert got["tokens"] == reference.tokens[: len(got["tokens"])]


def test_join_with_mesh_refuses_bad_combinations(model: Path) -> None:
    both = cli("serve", "--model", str(model), "--mesh", "abc12345", "--layers", "0:15")
    assert both.returncode != 0
    assert "not both" in both.stderr
    blind = cli("serve", "--mesh", "SmolLM2", "--layers", "0:15")
    assert blind.returncode != 0
    assert "--tracker" in blind.stderr



def test_the_walkthrough_in_docs_runs_as_written(model: Path, tmp_path: Path) -> None:
    """docs/fetch.md's blocks, in order, in a network namespace of their own (as tests/test_readme.py)."""
    from meshnode.runtime.paths import cache_dir
    from tests.test_readme import ROOT, _run_in_netns, _script, sh_blocks

    blocks = sh_blocks((ROOT / "docs" / "fetch.md").read_text())
    assert len(blocks) == 2, "a new block in docs/fetch.md: give it its checks here"
    work = tmp_path / "checkout"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "MESHNODE_CACHE_DIR": str(cache_dir())}
    env.pop("STATE_DIRECTORY", None)
    run = _run_in_netns(_script(blocks, work), env, timeout=600)
    out, err = ([(work / f"{kind}{i}").read_text() if (work / f"{kind}{i}").exists() else ""
                 for i in range(len(blocks))] for kind in ("out", "err"))
    assert run.returncode == 0, f"{run.stdout!r}\n" + "\n".join(o[-1500:] + e[-1500:]
                                                               for o, e in zip(out, err, strict=True))
    assert out[0].strip() == fingerprint(model)
    assert "--auto chose layers" in err[1]
    assert "fetched" in err[1]
    listed = [line for line in out[1].splitlines() if line.strip().startswith(("fetched", "range"))]
    assert any(line.split()[0] == "fetched" and " yes " in line for line in listed), out[1]
    assert any(line.split()[0] == "range" and " yes " in line for line in listed), out[1]
