"""What each layer of a hop's data path costs a decode token at 1.34 GB: ``python -m bench.ladder`` (issue 23, item 2).

The model's two halves run in two processes (``LlamaRange``, 2 threads each, as a node runs them on this
machine kind) that hand each other the residual and the sampled token over a loopback TCP socket; the head
drives the decode loop as a route's head does. Each *rung* adds one layer of what a node does per step:

* ``bare``: blocking sockets, a length prefix, the raw float32 residual out and the token back;
* ``proto``: the real wire messages: a ``LinkFrame`` holding a ``SessionFrame`` with a ``Step`` whose
  activation is an ``encode_bundle`` (CRC32C), parsed and ``decode_bundle``d at the tail, a ``LinkReply``
  with a ``StepResult`` and its ``HopTiming``s back;
* ``sealed``: plus the seals: the head digests its residual and signs after the send, the tail digests
  what it received and its logits and signs before it answers (``audit/seals.py``);
* ``asyncio``: the same, each process an asyncio loop on streams, the decode inline on the loop's thread
  (as a node's data plane runs a lone session's step);
* ``grpc``: the same over a grpc.aio bidirectional stream (no TLS), as a node's ``Link`` call is.

Against the whole model in ``Llama`` at 2 threads, in a process of its own; every side measured in turn
each round (the order rotated), decode over ``--tokens`` single-token steps after an 8-token prompt, and
the median of the rounds' ratios printed. ``--route`` adds two ``meshnode serve`` halves and
``meshnode generate`` (decode by difference, as ``bench.sizes`` measures it) as the last rung. What the
rungs say: the step from one rung to the next is what that layer costs; what the route loses beyond the
last rung is the session layer itself (checks, futures, outboxes, metrics, TLS, the trio thread, the
initiator's process).

``--pinned`` simulates two machines as ``bench.sizes --setting pinned`` does: one thread each, the whole
model, the head and a route's head node and initiator on CPU 0, the tail and a route's tail node on CPU 1;
the ``bare`` rung then shows what splitting the model over two processes on two cores costs by itself.

``--fresh`` adds the whole model as ``bench.sizes`` runs it: a ``Llama`` process started for the
measurement (``bench.route_bench``'s whole child, reading the weights again), beside the long-lived one
every ratio is taken against; its ratio says how much faster a fresh process decodes.

    python -m bench.ladder [--rounds 5] [--tokens 96] [--threads 2] [--pinned] [--fresh] [--route NAME] [--rung RUNG]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

RUNGS = ("bare", "proto", "sealed", "asyncio", "grpc")
PROMPT = np.arange(1, 9, dtype=np.int32)
METHOD = "/bench.Ladder/Link"
_LEN = struct.Struct("<I")


def _range(model: str, a: int, b: int, threads: int, as_node: bool) -> Any:
    from meshnode.executor._bindings import silence_llama_logs
    from meshnode.executor._llama import LlamaRange
    from meshnode.executor.config import ExecConfig
    from meshnode.gguf import ensure_range

    silence_llama_logs()
    cfg = (ExecConfig(n_threads=threads, n_threads_solo=threads, n_threads_batch=threads) if as_node  # a node's KV
           else ExecConfig(n_ctx_per_session=512, max_sessions=1, n_threads=threads, n_threads_solo=threads,
                           n_threads_batch=threads))
    r = LlamaRange(ensure_range(Path(model), a, b), cfg)
    r.decode_threads = threads
    return r


class _Hop:
    """One half's per-step work at a rung (the same code whichever transport carries the bytes)."""

    def __init__(self, rng: Any, rung: str) -> None:
        from meshnode.identity.keys import NodeIdentity
        from meshnode.proto import node_pb2 as pb

        self.r, self.rung, self.pb = rng, rung, pb
        self.ident = NodeIdentity.generate()
        self.cap = pb.Capability(model_fingerprint="0" * 64, range=pb.LayerRange(start=0, end=1),
                                 numerics=pb.Numerics(n_ctx_per_session=512, n_batch=512, n_ubatch=512))
        self.sid = "0" * 36
        #: steps taken, and from the second on (the prompt's is not a decode step): CPU and llama.cpp time
        self.steps, self.cpu0, self.compute = 0, 0.0, 0.0

    def forward(self, pos: int, **kw: Any) -> Any:
        if self.steps == 1:
            self.cpu0, self.compute = time.process_time(), 0.0
        self.steps += 1
        t0 = time.perf_counter()
        out = self.r.forward(0, pos, **kw)
        self.compute += time.perf_counter() - t0
        return out

    def usage(self) -> tuple[float, float]:
        """This process's CPU seconds and llama.cpp seconds per decode step."""
        n = max(self.steps - 1, 1)
        return (time.process_time() - self.cpu0) / n, self.compute / n

    def seal(self, step_id: int, pos: int, n: int, inp: bytes, out: bytes, token: int | None = None) -> Any:
        from meshnode.audit.seals import sign_step

        return sign_step(self.ident, self.cap, session_id=self.sid, epoch=1, step_id=step_id, pos_start=pos,
                         n_tokens=n, wire_dtype=self.pb.DTYPE_F32, input_sha256=inp, output_sha256=out,
                         token=token)

    # the head: build the message for the tail, and read its answer
    def head_step(self, step_id: int, pos: int, toks: np.ndarray) -> tuple[bytes, np.ndarray]:
        out = self.forward(pos, tokens=toks)
        if self.rung == "bare":
            return np.ascontiguousarray(out.residual, dtype="<f4").tobytes(), out.residual
        from meshnode.wire.tensors import encode_bundle

        pb = self.pb
        step = pb.Step(step_id=step_id, cache=pb.CacheExpectation(n_past=pos), sample=True,
                       activation=encode_bundle(out.residual, pos_start=pos))
        frame = pb.LinkFrame()
        frame.entries.add(stream=1, frame=pb.SessionFrame(route_session_id=self.sid, route_epoch=1, step=step))
        return frame.SerializeToString(), out.residual

    def head_after_send(self, step_id: int, pos: int, toks: np.ndarray, residual: np.ndarray) -> Any:
        """The head's seal, made once the residual is on its way (as ``session/hop.py`` orders it)."""
        if self.rung in ("bare", "proto"):
            return None
        from meshnode.audit.seals import rows_digest, tokens_digest

        return self.seal(step_id, pos, len(toks), tokens_digest(toks), rows_digest(residual, self.pb.DTYPE_F32))

    def head_read(self, data: bytes) -> int:
        if self.rung == "bare":
            return int(_LEN.unpack(data)[0])
        reply = self.pb.LinkReply.FromString(data)
        return int(reply.entries[0].reply.result.token)

    # the tail: answer one message
    def tail_step(self, data: bytes, pos: int) -> bytes:
        if self.rung == "bare":
            x = np.frombuffer(data, dtype="<f4").reshape(-1, self.r.n_embd)
            out = self.forward(pos, embd=x)
            return _LEN.pack(int(np.argmax(out.logits)))
        from meshnode.audit.seals import logits_digest, rows_digest
        from meshnode.wire.tensors import decode_bundle

        pb = self.pb
        frame = pb.LinkFrame.FromString(data)
        s = frame.entries[0].frame.step
        x = decode_bundle(s.activation, n_cols=self.r.n_embd)
        t0 = time.perf_counter_ns()
        out = self.forward(s.cache.n_past, embd=x)
        took = time.perf_counter_ns() - t0
        tok = int(np.argmax(out.logits))
        timing = pb.HopTiming(endpoint="tail", compute_nanos=took, bytes_in=len(data), n_tokens=1)
        if self.rung != "proto":
            timing.seal.CopyFrom(self.seal(s.step_id, s.cache.n_past, 1, rows_digest(x, pb.DTYPE_F32),
                                           logits_digest(out.logits), token=tok))
        result = pb.StepResult(step_id=s.step_id, token=tok, tokens=[tok], timings=[timing])
        reply = pb.LinkReply()
        reply.entries.add(stream=1, reply=pb.SessionReply(route_session_id=self.sid, result=result))
        return bytes(reply.SerializeToString())


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError("peer closed")
        buf += got
    return bytes(buf)


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> bytes:
    return _recv_exact(sock, _LEN.unpack(_recv_exact(sock, 4))[0])


class _Loop:
    """The head's decode loop, whatever carries its messages: the prompt's step, then ``tokens`` decode
    steps timed, each token fed back as the next step's input."""

    def __init__(self, hop: _Hop, tokens: int) -> None:
        hop.r.release(0)
        self.hop, self.tokens = hop, tokens
        self.toks, self.pos, self.t0 = PROMPT, 0, 0.0
        self.got: list[int] = []
        self.residual: Any = None

    def out(self, i: int) -> bytes:
        if i == 1:
            self.t0 = time.perf_counter()  # the prompt's step is not a decode step
        data, self.residual = self.hop.head_step(i + 1, self.pos, self.toks)
        return data

    def sent(self, i: int) -> None:
        self.hop.head_after_send(i + 1, self.pos, self.toks, self.residual)

    def back(self, data: bytes) -> None:
        self.got.append(self.hop.head_read(data))
        self.pos += len(self.toks)
        self.toks = np.array([self.got[-1]], dtype=np.int32)

    def result(self) -> tuple[float, list[int]]:
        return (time.perf_counter() - self.t0) / self.tokens, self.got


def _head_blocking(hop: _Hop, port: int, tokens: int) -> tuple[float, list[int]]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = _Loop(hop, tokens)
    for i in range(tokens + 1):
        _send(sock, loop.out(i))
        loop.sent(i)
        loop.back(_recv(sock))
    result = loop.result()
    _send(sock, b"")
    sock.close()
    return result


def _tail_blocking(hop: _Hop, srv: socket.socket) -> None:
    sock, _ = srv.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hop.r.release(0)
    pos = 0
    while data := _recv(sock):
        # bare carries no position: the tail keeps its own (the prompt's 8, then one a token)
        _send(sock, hop.tail_step(data, pos))
        pos += len(PROMPT) if pos == 0 else 1
    sock.close()


async def _head_asyncio(hop: _Hop, port: int, tokens: int) -> tuple[float, list[int]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = _Loop(hop, tokens)
    for i in range(tokens + 1):
        data = loop.out(i)
        writer.write(_LEN.pack(len(data)) + data)
        await writer.drain()
        await asyncio.sleep(0)  # the seal after the write has started, as the node yields once
        loop.sent(i)
        loop.back(await reader.readexactly(_LEN.unpack(await reader.readexactly(4))[0]))
    result = loop.result()
    writer.write(_LEN.pack(0))
    await writer.drain()
    writer.close()
    return result


async def _tail_asyncio(hop: _Hop, srv: socket.socket) -> None:
    done = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hop.r.release(0)
        pos = 0
        while n := _LEN.unpack(await reader.readexactly(4))[0]:
            out = hop.tail_step(await reader.readexactly(n), pos)
            writer.write(_LEN.pack(len(out)) + out)
            await writer.drain()
            pos += len(PROMPT) if pos == 0 else 1
        writer.close()
        done.set_result(None)

    server = await asyncio.start_server(serve, sock=srv)
    await done
    server.close()


async def _head_grpc(hop: _Hop, port: int, tokens: int) -> tuple[float, list[int]]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(METHOD)()
        loop = _Loop(hop, tokens)
        for i in range(tokens + 1):
            await call.write(loop.out(i))
            await asyncio.sleep(0)
            loop.sent(i)
            loop.back(await call.read())
        result = loop.result()
        await call.done_writing()
        await call.read()
    return result


async def _tail_grpc(hop: _Hop, port_out: Connection) -> None:
    import grpc

    done = asyncio.get_running_loop().create_future()

    async def link(requests: Any, context: Any) -> Any:
        hop.r.release(0)
        pos = 0
        async for data in requests:
            yield hop.tail_step(data, pos)
            pos += len(PROMPT) if pos == 0 else 1
        done.set_result(None)

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Ladder", {"Link": grpc.stream_stream_rpc_method_handler(link)})
    server.add_generic_rpc_handlers((handler,))
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await done
    await asyncio.sleep(0.5)  # the head closes its channel first (a GOAWAY to a live channel is logged)
    await server.stop(None)


def worker(role: str, model: str, cut: tuple[int, int], threads: int, conn: Connection, as_node: bool = False,
           cpus: tuple[int, ...] = ()) -> None:
    """A process holding one half (or the whole model, ``role`` "whole"): runs what the driver asks, on
    ``cpus`` only if given (``--pinned``)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if role == "whole":  # as bench.route_bench's whole child: weights read, greedy by argmax
        import llama_cpp

        llm = llama_cpp.Llama(model, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False,
                              use_mmap=False)
        n_vocab = llm.n_vocab()
        conn.send("ready")
        while (n := conn.recv()) is not None:
            llm.reset()  # type: ignore[no-untyped-call]
            llm.eval(PROMPT.tolist())
            got = []
            t0 = time.perf_counter()
            for _ in range(n):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
                got.append(int(np.argmax(logits)))
                llm.eval([got[-1]])
            conn.send(((time.perf_counter() - t0) / n, got))
        return
    from meshnode.executor import openmp

    openmp.configure(threads)  # the node's libgomp settings (an OpenMP build), before llama.cpp loads
    rng = _range(model, *cut, threads, as_node)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        rung, arg = msg
        hop = _Hop(rng, rung)
        if role == "head":
            if rung == "grpc":
                took, got = asyncio.run(_head_grpc(hop, arg["port"], arg["tokens"]))
            elif rung == "asyncio":
                took, got = asyncio.run(_head_asyncio(hop, arg["port"], arg["tokens"]))
            else:
                took, got = _head_blocking(hop, arg["port"], arg["tokens"])
            conn.send((took, got, hop.usage()))
            continue
        if rung == "grpc":
            asyncio.run(_tail_grpc(hop, conn))
        else:
            srv = socket.create_server(("127.0.0.1", 0))
            conn.send(srv.getsockname()[1])
            if rung == "asyncio":
                asyncio.run(_tail_asyncio(hop, srv))
            else:
                _tail_blocking(hop, srv)
            srv.close()
        conn.send(("done", hop.usage()))
    rng.close()


def _start(ctx: Any, role: str, model: Path, cut: tuple[int, int], threads: int,
           as_node: bool = False, cpus: tuple[int, ...] = ()) -> tuple[Any, Connection]:
    a, b = ctx.Pipe()
    p = ctx.Process(target=worker, args=(role, str(model), cut, threads, b, as_node, cpus), daemon=True)
    p.start()
    if a.recv() != "ready":
        raise SystemExit(f"the {role} worker did not start")
    return p, a


def _rung(head: Connection, tail: Connection, rung: str, tokens: int) -> tuple[float, list[int], list[Any]]:
    """(seconds a token, the tokens, each half's (CPU, llama.cpp) seconds a token)."""
    tail.send((rung, None))
    port = tail.recv()
    head.send((rung, {"port": port, "tokens": tokens}))
    took, got, head_use = head.recv()
    done, tail_use = tail.recv()
    if done != "done":
        raise SystemExit(f"the tail did not finish rung {rung}")
    return took, got, [head_use, tail_use]


def _cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` so far (user + system)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def _route_decode(peers: list[str], pids: list[int], extra: list[str],
                  cpus: tuple[int, ...] = ()) -> tuple[float, list[int], list[Any]]:
    """A route through ``meshnode generate``, decode by difference (as bench.sizes): (seconds a token, the
    tokens, per node (CPU, llama.cpp) seconds a token, then the initiator's CPU seconds a token)."""
    import resource

    from bench import paths

    def child() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    c0, i0 = [_cpu(p) for p in pids], child()
    ts, short = paths.generate(peers, paths.PROMPT, paths.SHORT, cpus, extra=extra)
    c1, i1 = [_cpu(p) for p in pids], child()
    tl, long = paths.generate(peers, paths.PROMPT, paths.LONG, cpus, extra=extra)
    c2, i2 = [_cpu(p) for p in pids], child()
    n = len(long["tokens"]) - len(short["tokens"])
    hops = long["hops"]["per_hop"]
    use: list[Any] = [((c2[k] - c1[k] - (c1[k] - c0[k])) / n, h["compute_ms"] / 1e3)
                      for k, h in enumerate(hops)]
    use.append(((i2 - i1) - (i1 - i0)) / n)
    return (tl - ts) / n, long["tokens"], use


def route_variant(text: str) -> tuple[str, list[str], str | None]:
    """``NAME[@DIR][:ARG,ARG...]``: a route whose ``meshnode serve`` nodes get these arguments, run from
    ``DIR`` (another copy of the code, e.g. a change's parent: an A/B of two versions in one run)."""
    head, _, args = text.partition(":")
    name, _, where = head.partition("@")
    if not name or (where and not Path(where, "meshnode").is_dir()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME[@DIR][:ARG,ARG...], DIR holding meshnode/")
    return f"route {name}", [a for a in args.split(",") if a], where or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ladder", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the 1.34 GB synthetic model, bench.synth)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rung", action="append", choices=[*RUNGS, *(f"{r}+node" for r in RUNGS)],
                    help="these rungs only (repeat; default: all); RUNG+node: its halves with a node's KV "
                         "settings (4 sessions, the file's context) instead of one session of 512")
    ap.add_argument("--route", type=route_variant, action="append", default=[], metavar="NAME[@DIR][:ARG,...]",
                    help="a route of two meshnode serve halves with these node arguments too (repeat), e.g. "
                         "default, t2:--threads,2 or before@/tmp/parent (nodes run from that copy's code)")
    ap.add_argument("--pinned", action="store_true",
                    help="two machines simulated, as bench.sizes --setting pinned: one thread each, the whole "
                         "model, the head (and a route's initiator) on CPU 0, the tail on CPU 1")
    ap.add_argument("--fresh", action="store_true",
                    help="the whole model in a process started for each measurement too, as bench.sizes runs it")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from bench.paths import huge_pages_here

    huge_pages_here()  # the halves and the whole model in the pages a node's weights are in
    if ns.pinned:
        ns.threads = 1
    place = {"whole": (0,), "head": (0,), "tail": (1,)} if ns.pinned else {}
    from bench.synth import ensure_model
    from meshnode.gguf.model import inspect_model

    model = Path(ns.model) if ns.model else ensure_model(1.0)
    n = inspect_model(model).n_layer
    rungs = list(ns.rung or RUNGS)
    print(f"command: python -m bench.ladder {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{model.name}: halves 0:{n // 2} and {n // 2}:{n} at {ns.threads} threads; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    ctx = mp.get_context("spawn")
    procs = []
    pw, whole = _start(ctx, "whole", model, (0, n), ns.threads, cpus=place.get("whole", ()))
    procs.append(pw)
    pairs: dict[bool, tuple[Connection, Connection]] = {}
    for as_node in sorted({r.endswith("+node") for r in rungs}):
        (ph, head), (pt, tail) = (_start(ctx, "head", model, (0, n // 2), ns.threads, as_node, place.get("head", ())),
                                  _start(ctx, "tail", model, (n // 2, n), ns.threads, as_node, place.get("tail", ())))
        procs += [ph, pt]
        pairs[as_node] = (head, tail)
    import contextlib

    from bench import paths
    from meshnode.runtime.launch import start_node

    stack = contextlib.ExitStack()
    routes: dict[str, tuple[list[str], list[int], list[str], tuple[int, ...]]] = {}
    for name, args, where in ns.route:
        nodes = []
        for cut, role in ((f"0:{n // 2}", "head"), (f"{n // 2}:{n}", "tail")):
            nodes.append(start_node(model, cut, extra=args, prefix=["env", "-C", where] if where else (),
                                    cpus=place.get(role, ())))
            stack.callback(nodes[-1].stop)
        extra = [a for a in args if a == "--insecure"]  # the initiator speaks as the nodes do
        routes[name] = ([x.endpoint for x in nodes], [x.proc.pid for x in nodes], extra, place.get("head", ()))
        paths.generate(routes[name][0], paths.PROMPT, 4, place.get("head", ()), extra=extra)  # warm-up
    sides = ["whole", *rungs, *routes, *(["fresh"] if ns.fresh else [])]
    ratios: dict[str, list[float]] = {s: [] for s in sides[1:]}
    times: dict[str, list[float]] = {s: [] for s in sides}
    uses: dict[str, list[list[Any]]] = {s: [] for s in sides[1:]}
    equal = True
    try:
        for k in range(ns.rounds):
            order = sides[k % len(sides):] + sides[:k % len(sides)]
            got: dict[str, float] = {}
            ref: list[int] | None = None
            for side in order:
                if side == "whole":
                    whole.send(ns.tokens)
                    got[side], ids = whole.recv()
                    ref = ref or ids
                elif side == "fresh":  # a text prompt, as bench.sizes: its tokens are not compared here
                    got[side] = 1 / paths.whole_decode(model, ns.threads, ns.tokens, place.get("whole", ()))[
                        "decode_tps"]
                    continue
                elif side in routes:  # through meshnode generate, decode by difference (as bench.sizes)
                    got[side], _, use = _route_decode(*routes[side])
                    uses[side].append(use)
                    continue  # its prompt is text, not the rungs' ids: its tokens are not compared here
                else:
                    got[side], ids, use = _rung(*pairs[side.endswith("+node")], side.removesuffix("+node"),
                                                ns.tokens)
                    uses[side].append(use)
                if ref is not None and ids[: len(ref)] != ref[: len(ids)]:
                    equal = False
                ref = ref or ids
            for s in sides:
                times[s].append(got[s])
            for s in sides[1:]:
                ratios[s].append(got["whole"] / got[s])
            print(f"round {k + 1}: whole {1 / got['whole']:.2f} tok/s; "
                  + ", ".join(f"{s} {1 / got[s]:.2f} ({ratios[s][-1]:.3f})" for s in sides[1:]), flush=True)
    finally:
        for c in (whole, *(c for pair in pairs.values() for c in pair)):
            c.send(None)
        for p in procs:
            p.join(timeout=30)
        stack.close()
    print(f"\ntokens equal on every side: {equal}")
    print("| side | ms a token (median) | tok/s | ratio to the whole model (median of the rounds) | rounds |")
    print("|---|---|---|---|---|")
    med = {s: statistics.median(times[s]) for s in sides}
    print(f"| whole model, `Llama` | {med['whole'] * 1e3:.2f} | {1 / med['whole']:.2f} | 1 | |")
    for s in sides[1:]:
        print(f"| {s} | {med[s] * 1e3:.2f} | {1 / med[s]:.2f} | {statistics.median(ratios[s]):.3f} | "
              f"{', '.join(f'{x:.3f}' for x in ratios[s])} |")
    print("\nCPU a decode token, ms (median of the rounds): each process's CPU, its time inside llama.cpp, and "
          f"the CPU beyond {ns.threads} threads' llama.cpp time (its handling, the transport, idle threads)")
    print("| side | head CPU | head llama.cpp | head beyond | tail CPU | tail llama.cpp | tail beyond | initiator |")
    print("|---|---|---|---|---|---|---|---|")
    for s in (s for s in sides[1:] if uses[s]):
        cpu = [[1e3 * statistics.median(float(u[i][j]) for u in uses[s]) for j in (0, 1)] for i in (0, 1)]
        over = [1e3 * statistics.median(float(u[i][0] - ns.threads * u[i][1]) for u in uses[s]) for i in (0, 1)]
        init = f"{1e3 * statistics.median(float(u[2]) for u in uses[s]):.2f}" if s in routes else ""
        print(f"| {s} | {cpu[0][0]:.2f} | {cpu[0][1]:.2f} | {over[0]:.2f} | {cpu[1][0]:.2f} | {cpu[1][1]:.2f} | "
              f"{over[1]:.2f} | {init} |")
    if ns.json:
        print(json.dumps({"ratios": ratios, "seconds": times, "cpu": uses, "tokens_equal": equal}))
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
