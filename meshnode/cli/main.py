"""The meshnode command line: flags -> config -> trio.run.

Exit codes: 0 success, 2 bad input (flags, ranges, routes), 1 any other
typed failure (model, peer, wire), each printed as one ``meshnode: error:``
line naming its code and, for a peer's failure, the hop.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import trio

from meshnode import __version__, errors
from meshnode.audit.policy import DEFAULT_AUDIT
from meshnode.cli.flags import check_url, exec_config
from meshnode.executor.config import ExecConfig

if TYPE_CHECKING:
    from meshnode.runtime.nodes import Running
    from meshnode.session.hop import HopLimits


def parse_layers(text: str, flag: str = "--layers") -> tuple[int, int]:
    """``A:B`` -> (A, B); ``LayerRangeError`` naming ``flag`` otherwise."""
    a, sep, b = text.partition(":")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit():
        raise errors.LayerRangeError(f"{flag} {text!r} is not A:B (two layer numbers, B exclusive)")
    start, end = int(a), int(b)
    if start >= end:
        raise errors.LayerRangeError(f"{flag} {text!r} is empty: A must be below B")
    return start, end


def _model(ns: argparse.Namespace) -> Path:
    if ns.model:
        return Path(ns.model)
    from meshnode.models import pull

    return pull()


def _hop_limits(ns: argparse.Namespace) -> HopLimits:
    """What one party may make this node do (session/admission.py), from flags and the config file."""
    from meshnode.session.hop import HopLimits

    base = HopLimits()
    rate = base.opens_per_minute if ns.max_opens_per_minute is None else ns.max_opens_per_minute
    detached = ns.max_detached or 0
    if rate <= 0:
        raise errors.InputError(f"--max-opens-per-minute must be above 0, not {rate:g}")
    if detached < 0:
        raise errors.InputError(f"--max-detached must be at least 1, not {detached}")
    return HopLimits(opens_per_minute=rate, opens_burst=min(base.opens_burst, max(1.0, rate)), max_detached=detached,
                     link=not getattr(ns, "no_link", False))


def _add_node_choice(p: argparse.ArgumentParser, which: str) -> None:
    p.add_argument("--state-dir", help=f"{which} running with this state dir")
    p.add_argument("--listen", action="append", default=[], metavar="HOST:PORT",
                   help=f"{which} started with (or bound to) this address, under the default state dir (repeat)")


def _add_exec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int,
                   help="llama.cpp threads for decode (default: while one session is live, the physical cores "
                        "this process may use or half of them, whichever measures faster; half while several are)")
    p.add_argument("--threads-batch", type=int,
                   help="llama.cpp threads for prefill (default: the cores this process may use)")
    p.add_argument("--max-sessions", type=int, help="concurrent sessions (KV sequences), default 4")
    p.add_argument("--ctx-size", type=int, metavar="TOKENS",
                   help="context of each session, prompt + output (default: the model's training context, "
                        "less if the KV cache of all sessions would take over a quarter of the available memory)")
    p.add_argument("--mmap", action=argparse.BooleanOptionalAction,
                   help="map the range's file (--mmap) or read its weights into memory (--no-mmap); default: read "
                        "while they take at most half the memory available, else map. Mapped, decode speed "
                        "depends on how the page cache holds the file (docs/performance.md)")
    p.add_argument("--linger", metavar="SECONDS",
                   help="after each step, keep this node's CPU awake for the next one, up to twice the last gap "
                        "between steps and at most SECONDS (default 1, or MESHNODE_LINGER; 0: never): a core "
                        "that idles between steps wakes slower (docs/performance.md, \"Lingering between steps\"). "
                        "The spinner runs at the lowest priority and rests where other work took its core")
    p.add_argument("--decode-on-worker", action="store_true",
                   help="hand single-token decode steps to the llama.cpp worker thread too (default: they run "
                        "on the data-plane loop's thread, two thread wake-ups less per step)")


# -- commands ---------------------------------------------------------------------


def cmd_model_pull(ns: argparse.Namespace) -> int:
    from meshnode.models import DEFAULT_MODEL, KNOWN, pull

    if ns.name is not None and ns.name not in KNOWN:
        raise errors.InputError(f"no model named {ns.name!r}; known: {', '.join(sorted(KNOWN))}")
    print(pull(KNOWN[ns.name] if ns.name else DEFAULT_MODEL, force=ns.force))
    return 0


def cmd_model_slice(ns: argparse.Namespace) -> int:
    """The artifact as JSON on stdout; progress and a one-line summary on stderr."""
    import time

    from meshnode.gguf import ensure_range
    from meshnode.gguf.progress import LineProgress

    start, end = parse_layers(ns.layers)
    model = _model(ns)
    t0 = time.monotonic()
    art = ensure_range(model, start, end, LineProgress(f"cutting layers {start}:{end} of {model.name}"))
    size = sum(f.stat().st_size for f in (art.dir / "range.gguf", art.dir / "vocab.gguf") if f.exists())
    print(f"meshnode: layers {start}:{end} of {model.name} ({art.role.value}): {size / 1e6:.0f} MB in {art.dir}, "
          f"range digest {art.range_digest[:12]}… ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    print(json.dumps({"dir": str(art.dir), "role": art.role.value, "range": [start, end],
                      "range_digest": art.range_digest, "fingerprint": art.fingerprint}))
    return 0


def cmd_model_id(ns: argparse.Namespace) -> int:
    """The model id (the sha256 of the file's manifest), or with --manifest the manifest itself."""
    from meshnode.modelid import manifest_of

    m = manifest_of(Path(ns.file).expanduser())
    if ns.manifest:
        sys.stdout.buffer.write(m.canonical() + b"\n")
    else:
        print(m.model_id)
    return 0


def _gb(value: float | None, flag: str) -> int | None:
    if value is None:
        return None
    if value < 0:
        raise errors.InputError(f"{flag} is GB, 0 or more")
    return int(value * 1e9)


def cmd_model_ls(ns: argparse.Namespace) -> int:
    """Whole files, fetched models and ranges in the cache: sizes on disk, ids, which are served."""
    from meshnode.cache import scan
    from meshnode.runtime.paths import cache_dir

    entries = scan()
    if ns.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries]))
        return 0
    print(f"{cache_dir()}:")
    print(f"  {'kind':<8} {'MB':>9}  {'model id':<16}  {'layers':<7}  {'served':<6}  name / path")
    for e in entries:
        print(f"  {e.kind:<8} {e.bytes / 1e6:>9.1f}  {(e.model_id[:16] or '?'):<16}  {e.layers or '-':<7}  "
              f"{'yes' if e.served else 'no':<6}  {e.name}  {e.path}")
    total = sum(e.bytes for e in entries)
    print(f"  {len(entries)} entries, {total / 1e9:.2f} GB on disk")
    return 0


def cmd_model_rm(ns: argparse.Namespace) -> int:
    """Remove what TARGET names (a model id prefix: its ranges, fetched copy and known files; or a path);
    what a running node serves is refused."""
    from meshnode.cache import remove, scan
    from meshnode.modelid.manifest import is_id_prefix

    entries = scan()
    target = ns.target.lower()
    if is_id_prefix(target):
        chosen = [e for e in entries if e.model_id.startswith(target)]
    else:
        p = str(Path(ns.target).expanduser().resolve())
        chosen = [e for e in entries if str(Path(e.path).resolve()) == p or str(Path(e.path).resolve().parent) == p]
    if ns.ranges:
        chosen = [e for e in chosen if e.kind == "range"]
    if not chosen:
        raise errors.InputError(f"nothing in the cache is {ns.target!r} (see `meshnode model ls`)")
    served = [e for e in chosen if e.served]
    if served:
        raise errors.InputError("in use by a running node (leave it first): " + ", ".join(e.path for e in served))
    for e in chosen:
        remove(e)
        print(f"removed {e.kind} {e.path} ({e.bytes / 1e6:.0f} MB)")
    return 0


def cmd_model_gc(ns: argparse.Namespace) -> int:
    """Remove unserved ranges and fetched models, least recently used first, down to --limit GB."""
    from meshnode.cache import enforce

    limit = _gb(ns.limit, "--limit")
    assert limit is not None
    gone = enforce(limit)
    for e in gone:
        print(f"removed {e.kind} {e.path} ({e.bytes / 1e6:.0f} MB)")
    print(f"{len(gone)} removed, {sum(e.bytes for e in gone) / 1e6:.0f} MB freed")
    return 0


def cmd_model_inspect(ns: argparse.Namespace) -> int:
    """Architecture, size, experts, context, chat template, and where the model can be cut exactly."""
    from meshnode.gguf.report import describe, render

    d = describe(Path(ns.file).expanduser())
    print(json.dumps(d, indent=1) if ns.json else render(d))
    return 0


def _node_settings(ns: argparse.Namespace) -> argparse.Namespace:
    """Flags, then the --config file, then built-in defaults (meshnode.config)."""
    from meshnode import config

    file = config.load(Path(ns.config)) if ns.config else {}
    flags = {k: getattr(ns, k, None) for k in config.KEYS}
    for key in ("auto", "insecure", "api_tls"):  # a store_true flag not given must not override the file
        if flags.get(key) is False:
            flags[key] = None
    merged = config.resolve(flags, file)
    for k, v in merged.items():
        setattr(ns, k, v)
    return ns


INSECURE_HELP = ("plaintext node streams, no TLS and no pinning to node ids: for a closed lab network only "
                 "(every node and client of the mesh must say it)")


def _configure_security(ns: argparse.Namespace) -> None:
    """TLS pinned to node ids unless --insecure (transport/security.py); grpc is imported only when said."""
    if getattr(ns, "insecure", False):
        from meshnode.transport import security

        security.configure(insecure=True)


def _fetch_share(ns: argparse.Namespace, auto: bool) -> tuple[Path, int, int]:
    """``--mesh NAME`` with no model file here: find the nodes that serve it, take the range given (or
    the weakest-covered one), and fetch what it needs from them (meshnode/fetch)."""
    from meshnode.cli.membership import node_memory, replicas_per_layer
    from meshnode.executor.probe import probe_span, step_time
    from meshnode.fetch.join import fetch_range, find_holders, manifest_for
    from meshnode.routing.sizing import layer_bytes, peer_steps, relative_speed, sized_range

    for url in ns.tracker or ():
        check_url(url)
    holders = trio.run(functools.partial(find_holders, ns.mesh, tracker=ns.tracker, mdns=ns.mdns))
    if auto:
        manifest = trio.run(manifest_for, holders)
        weights = layer_bytes([(t.name, t.n_bytes) for t in manifest.tensors], holders.n_layer)
        memory = node_memory(ns.memory)
        # this machine's speed on a few of the model's own layers, fetched first (they are fetched anyway
        # if the range chosen holds them), against what the holders advertise
        a, b = probe_span(holders.n_layer)
        speed = 1.0
        if b > a:
            probe_path, _ = trio.run(fetch_range, holders, a, b)
            speed = relative_speed(step_time(probe_path, holders.n_layer, list(weights.per)),
                                   peer_steps(weights, holders.step_times))
        start, end = sized_range(replicas_per_layer(holders.ranges, holders.n_layer), weights, memory, ns.span or 0,
                                 speed)
        print(f"meshnode: --auto chose layers {start}:{end} (the weakest-covered range that "
              f"{memory / 1e9:.1f} GB of memory holds; speed {speed:.2f} of the mesh's nodes)", file=sys.stderr)
    else:
        start, end = parse_layers(ns.layers)
    if not 0 <= start < end <= holders.n_layer:
        raise errors.LayerRangeError(f"layers {start}:{end} are not within the model's {holders.n_layer}")
    print(f"meshnode: {holders.name} is model {holders.model_id[:16]}…, served by {len(holders.peers)} nodes; "
          f"fetching what layers {start}:{end} need", file=sys.stderr)
    path, report = trio.run(fetch_range, holders, start, end)
    got = ", ".join(f"{peer} {n / 1e6:.0f} MB" for peer, n in sorted(report.by_peer.items())) or "all here already"
    print(f"meshnode: fetched {report.bytes / 1e6:.0f} MB in {report.pieces} checked pieces ({got})"
          + (f"; dropped {', '.join(report.dropped)}" if report.dropped else ""), file=sys.stderr)
    return path, start, end


def cmd_serve(ns: argparse.Namespace) -> int:
    from meshnode.executor import openmp

    ns = _node_settings(ns)
    if ns.huge_pages is not False:  # first: everything below (~0.6 s of imports) would be done twice
        from meshnode.executor.hugepages import reexec_with_huge_pages

        reexec_with_huge_pages()
    openmp.configure(ns.threads or ExecConfig().n_threads_solo)  # before llama.cpp loads: libgomp reads it once
    from meshnode.executor._bindings import silence_llama_logs
    from meshnode.node import NodeConfig, run_node

    for url in ns.tracker or ():
        check_url(url)
    from meshnode.transport.server import split_hostport as _hostport

    for b in ns.bootstrap or ():
        _hostport(b, "--bootstrap")
    auto = getattr(ns, "join", False) and ns.auto
    if auto and ns.layers:
        raise errors.InputError("give --layers or --auto, not both")
    if not auto and not ns.layers:
        raise errors.LayerRangeError("give --layers A:B" + (" or --auto" if getattr(ns, "join", False) else ""))
    if ns.mesh and ns.model:
        raise errors.InputError("give --model (a file here) or --mesh (fetch it from the mesh's nodes), not both")
    if ns.share_rate is not None and ns.share_rate < 0:
        raise errors.InputError("--share-rate is MiB a second, 0 or more")
    if ns.mesh:
        model, start, end = _fetch_share(ns, auto)
    elif auto:
        from meshnode.cli.membership import auto_range, node_memory

        model = _model(ns)
        memory = node_memory(ns.memory)
        start, end, speed = auto_range(model, ns.span, tracker=ns.tracker, mdns=ns.mdns, memory=memory)
        print(f"meshnode: --auto chose layers {start}:{end} (the weakest-covered range that "
              f"{memory / 1e9:.1f} GB of memory holds; speed {speed:.2f} of the mesh's nodes)", file=sys.stderr)
    else:
        model = _model(ns)
        start, end = parse_layers(ns.layers)
    rate = int((64 if ns.share_rate is None else ns.share_rate) * (1 << 20))
    cfg = NodeConfig(model=model, start=start, end=end, share_rate=rate,
                     cache_limit=_gb(ns.cache_limit, "--cache-limit"), bootstrap=tuple(ns.bootstrap or ()),
                     listen=ns.listen, executor=exec_config(ns),
                     state_dir=Path(ns.state_dir) if ns.state_dir else None, mdns_interface=ns.mdns,
                     tracker=tuple(ns.tracker or ()), heartbeat=ns.heartbeat, drain_timeout=ns.drain_timeout,
                     metrics=ns.metrics, api=ns.api, api_key=api_key_of(ns.api_key), insecure=ns.insecure,
                     limits=_hop_limits(ns), api_tls=bool(ns.api_tls))
    _configure_security(ns)
    if cfg.api:

        from meshnode.api.run import check_key
        from meshnode.http.tls import check_plain

        host, _ = check_key(cfg.api, cfg.api_key)  # a key off loopback, and HTTPS unless --insecure
        if not cfg.api_tls:
            check_plain(host, "the API (--api)", insecure=cfg.insecure,
                        flags="--api-tls (a self-signed certificate kept in the state dir)")
    if not ns.verbose:
        silence_llama_logs()

    async def main() -> None:
        # SIGTERM/SIGINT = leave: the node drains (new sessions refused, live ones get
        # --drain-timeout seconds), deregisters from mDNS and the tracker, and exits 0;
        # a second signal stops it at once
        stop = trio.Event()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def node(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
                    await run_node(cfg, stop=stop, task_status=task_status)
                    nursery.cancel_scope.cancel()  # drained and gone

                addr = await nursery.start(node)
                print(f"meshnode: serving layers {start}:{end} listening on {addr}", flush=True)
                async for _ in signals:
                    if stop.is_set():
                        nursery.cancel_scope.cancel()
                    stop.set()

    trio.run(main)
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from meshnode.cli.generation import Runner

    if ns.system and not ns.chat:
        raise errors.InputError("--system goes with --chat")
    messages = (*((("system", ns.system),) if ns.system else ()), ("user", ns.chat)) if ns.chat else ()
    runner = Runner.from_flags(ns)
    cfg = runner.config(prompt=ns.prompt or "", messages=messages)
    on_token = _stream_printer(ns.json) if ns.stream else None
    result = runner.run(cfg, on_token)
    _print_result(result, ns.json, streamed=on_token is not None)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from meshnode.cli.chatrepl import run_chat
    from meshnode.cli.generation import Runner

    return run_chat(Runner.from_flags(ns), system=ns.system)


def _stream_printer(as_json: bool) -> Callable[[int | None, bytes], None]:
    """--stream: the text as it is released (a JSON line per token with --json; token null: the last of it)."""
    def show(token: int | None, piece: bytes) -> None:
        if as_json:
            print(json.dumps({"token": token, "piece": piece.decode("utf-8", errors="replace")}), flush=True)
        else:
            sys.stdout.buffer.write(piece)
            sys.stdout.flush()

    return show


def _print_result(result: object, as_json: bool, streamed: bool = False) -> None:
    from meshnode.session.initiator import GenerationResult

    assert isinstance(result, GenerationResult)
    if as_json:
        rate = result.decode_tokens_per_second()
        print(json.dumps({
            "text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
            "stop_reason": result.stop_reason, "route": result.route,
            "prefill_seconds": round(result.prefill_seconds, 6), "decode_seconds": round(result.decode_seconds, 6),
            "decode_tokens_per_second": round(rate, 2) if rate is not None else None,
            "failovers": result.failovers, "seed": result.seed, "audit": result.audit, "draft": result.draft,
            "hops": result.hops,
        }))
    elif streamed:
        print()  # the text went out token by token
    else:
        print(result.text)


def cmd_id(ns: argparse.Namespace) -> int:
    from meshnode.identity import load_or_create
    from meshnode.runtime.paths import state_dir

    if ns.state_dir:
        sdir = Path(ns.state_dir)
    elif ns.listen:
        from meshnode.runtime.nodes import node_state_dir
        from meshnode.transport.server import split_hostport

        sdir = node_state_dir(None, *split_hostport(ns.listen))[0]
    else:
        sdir = state_dir()
    ident = load_or_create(sdir)
    if ns.json:
        print(json.dumps({"node_id": ident.node_id, "public_key": ident.public_key.hex()}))
    else:
        print(ident.node_id)
    return 0


def cmd_peers(ns: argparse.Namespace) -> int:
    from meshnode.discovery.mdns import PeerTable, run_mdns

    table = PeerTable()

    async def main() -> None:
        from meshnode.transport.aiothread import open_aio_thread

        async with open_aio_thread() as aio, trio.open_nursery() as nursery:
            await nursery.start(functools.partial(run_mdns, table, interface=ns.mdns, aio=aio.run))
            await trio.sleep(ns.wait)
            nursery.cancel_scope.cancel()

    trio.run(main)
    rows = [{"node_id": e.node_id, "endpoint": e.endpoint, "range": [e.capability.range.start, e.capability.range.end],
             "model": e.capability.model_fingerprint, "role": e.capability.role, "source": e.source}
            for e in sorted(table.live().values(), key=lambda e: (e.capability.range.start, e.node_id))]
    if ns.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['node_id']}  {r['endpoint']:<22} layers {r['range'][0]}:{r['range'][1]}  {r['role']}")
    return 0


def _targets(ns: argparse.Namespace, *, every: bool) -> Callable[[], list[Running]]:
    """The nodes ``leave``/``status`` name (membership.select), found anew at each call."""
    from meshnode.cli.membership import select
    from meshnode.runtime.paths import state_dir

    if ns.state_dir and ns.listen:  # answered at once, not retried by status --wait
        raise errors.InputError("give --state-dir or --listen (a node under the default state dir), not both")
    explicit = Path(ns.state_dir) if ns.state_dir else None
    return lambda: select(state_dir(), explicit, ns.listen, every=every)


def cmd_leave(ns: argparse.Namespace) -> int:
    from meshnode.cli.membership import leave

    if ns.all and (ns.state_dir or ns.listen):
        raise errors.InputError("give --all (every node under the default state dir) or --state-dir/--listen")
    for r in leave(_targets(ns, every=ns.all)(), ns.timeout):
        info = r.info or {}
        print(f"meshnode: node {info.get('node_id', '?')} (layers {info.get('layers', '?')}, "
              f"{info.get('endpoint', 'starting')}) has left")
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from meshnode.cli.membership import status, wait_serving

    targets = _targets(ns, every=True)
    doc = status(wait_serving(targets, ns.wait) if ns.wait is not None else targets())
    if ns.json:
        print(json.dumps(doc))
        return 0
    for n in doc["nodes"]:
        if n.get("starting") or n.get("error"):
            print(f"node (pid {n['pid']})  {n.get('error') or 'starting'}  state dir {n['state_dir']}")
            continue
        print(f"node {n['node_id']}  {n['endpoint']}  layers {n['range'][0]}:{n['range'][1]} ({n['role']})  "
              f"{'serving' if n['serving'] else 'draining'}  sessions {n['live_sessions']} live / "
              f"{n['free_sessions']} free  state dir {n['state_dir']}")
    if doc["peers"]:
        print(f"{'peer':<36} {'endpoint':<22} {'layers':<8} {'role':<7} {'alive':<6} sessions  tok/s")
    for p in doc["peers"]:
        print(f"{p['node_id']:<36} {(p['endpoints'] or ['-'])[0]:<22} {p['range'][0]}:{p['range'][1]:<5} "
              f"{p['role']:<7} {'yes' if p['alive'] else 'no':<6} {p['live_sessions']}/{p['free_sessions']:<7} "
              f"{p['decode_tokens_per_second']}")
    return 0


def api_key_of(api_key: str | None) -> str | None:
    """--api-key, else $MESHNODE_API_KEY (not visible in ps), else None. Without importing meshnode.api:
    that package brings starlette, hypercorn and zeroconf (7.7 MB of a node's RSS), which a node without --api
    never uses."""
    import os

    return api_key or os.environ.get("MESHNODE_API_KEY") or None


def api_config(listen: str, api_key: str | None, *, insecure: bool = False, tls: Any = None) -> Any:
    """The API's settings from flags; the key may come from $MESHNODE_API_KEY (not visible in ps)."""
    from meshnode.api import ApiConfig

    return ApiConfig(listen=listen, api_key=api_key_of(api_key), insecure=insecure, tls=tls)


def cmd_api(ns: argparse.Namespace) -> int:
    from meshnode.api import MeshSource, run_api
    from meshnode.api.run import check_exposure, check_key
    from meshnode.transport.server import split_hostport

    if not (ns.peer or ns.tracker or ns.mdns):
        raise errors.InputError("meshnode api needs a way to find the mesh: --peer HOST:PORT (repeat), "
                                "--tracker URL and/or --mdns ADDR")
    for p in ns.peer:
        split_hostport(p)
    if not ns.request_timeout > 0:
        raise errors.InputError("--request-timeout must be a number of seconds > 0")
    from meshnode.http.tls import base_url, tls_of
    from meshnode.runtime.paths import state_dir

    host, _ = check_key(ns.listen, api_key_of(ns.api_key))  # the key first: it is what guards the API
    tls = tls_of(ns, host, "the API", state_dir(), "api-tls")
    if not 1 <= ns.draft_max <= 64:
        raise errors.InputError(f"--draft-max must be from 1 to 64, not {ns.draft_max}")
    cfg = dataclasses.replace(api_config(ns.listen, ns.api_key, insecure=ns.insecure, tls=tls),
                              deadline=ns.request_timeout, draft="" if ns.draft == "none" else ns.draft,
                              draft_max=ns.draft_max)
    check_exposure(cfg)
    for url in ns.tracker or ():
        check_url(url)
    source = MeshSource(peers=tuple(ns.peer), tracker=tuple(ns.tracker or ()), mdns=ns.mdns)

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                addr = await nursery.start(functools.partial(run_api, cfg, source))
                h, _, p = addr.rpartition(":")
                note = f" (certificate sha256={tls.fingerprint})" if tls is not None else ""
                print(f"meshnode: API listening on {base_url(h, int(p), tls)}/v1{note}", flush=True)
                async for _ in signals:
                    nursery.cancel_scope.cancel()

    trio.run(main)
    return 0


def cmd_demo(ns: argparse.Namespace) -> int:
    from meshnode.cli.demo import run_demo

    return run_demo(prompt=ns.prompt, max_tokens=ns.max_tokens)


def cmd_verify_evidence(ns: argparse.Namespace) -> int:
    """Exit 0: the lie is confirmed; 1: refuted; 2: malformed evidence; 3: not verifiable with --model."""
    from meshnode.audit.verify import render, verify_file
    from meshnode.executor._bindings import silence_llama_logs

    if not ns.verbose:
        silence_llama_logs()
    report = verify_file(Path(ns.file), Path(ns.model))
    print(json.dumps(report.doc) if ns.json else render(report))
    return report.exit


def _add_route_flags(p: argparse.ArgumentParser) -> None:
    """Where generate and chat run: a route (--peer/--spare), one found (--mesh), or the whole model here."""
    p.add_argument("--peer", action="append", default=[], help="HOST:PORT of a hop, in layer order (repeat)")
    p.add_argument("--model", help="without --peer: run this whole GGUF here")
    p.add_argument("--mesh", metavar="NAME_OR_FINGERPRINT",
                   help="find a route for this model: its file name (SmolLM2-135M-Instruct), general.name, "
                        "or its model id (the sha256 of its manifest) / a prefix of 8+ hex digits; any case")
    p.add_argument("--mdns", metavar="ADDR", help="with --mesh: browse mDNS on this interface address")
    p.add_argument("--tracker", metavar="URL", action="append",
                   help="with --mesh: look the model up on this tracker (repeat: all are asked at once, any one "
                        "answering is enough); a hop caught lying is reported to each")
    p.add_argument("--bootstrap", action="append", default=[], metavar="HOST:PORT",
                   help="with --mesh: a live node of the mesh to learn the others from (its directory; repeat); "
                        "needs no tracker (docs/directory.md)")
    p.add_argument("--discover-timeout", type=float, default=5.0, help="with --mesh: seconds to look for peers")
    p.add_argument("--spare", action="append", default=[], metavar="HOST:PORT",
                   help="with --peer: another peer of the model; takes over the span of a hop that fails (repeat)")
    p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    p.add_argument("--rejoin-wait", type=float, default=5.0, metavar="SECONDS",
                   help="when a failed hop has no spare, wait this long for it to come back (default 5)")
    p.add_argument("--step-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a hop that answers no step within this long is taken for failed: the route fails over "
                        "(default 30; a silent network partition is noticed no sooner)")
    p.add_argument("--wire-dtype", choices=["f32", "f16"], default="f32",
                   help="residual dtype on the wire; f16 is NOT bit-exact")
    a = DEFAULT_AUDIT
    p.add_argument("--audit-rate", type=float, default=a.rate, metavar="P",
                   help="spot checks: the share of sessions whose hops a replica recomputes, once every node is "
                        f"past probation (0..1, default {a.rate:g}; docs/security.md)")
    p.add_argument("--audit-probation", type=int, default=a.probation, metavar="N",
                   help=f"audit every session through a node until N of its sessions checked out "
                        f"(default {a.probation})")
    p.add_argument("--audit-every", type=int, default=a.every, metavar="STEPS",
                   help=f"steps between two checks of an audited session: the check covering a lie starts "
                        f"within this many steps of it (default {a.every})")
    p.add_argument("--draft", choices=["none", "ngram"], default="none",
                   help="speculative decoding across the route: 'ngram' drafts the continuation of the text's "
                        "last n-gram where it occurred before (prompt lookup, no model), and the route verifies "
                        "the drafts in one step; the text is exactly the text without drafting (default none; "
                        "an audited session does not draft)")
    p.add_argument("--draft-max", type=int, default=8, metavar="K",
                   help="the most tokens one step drafts (default 8; fewer while drafts fail)")
    p.add_argument("--model-draft", metavar="PATH",
                   help="speculative decoding with this small GGUF run whole here as the drafter (greedy); its "
                        "vocabulary must be the route's model's (refused otherwise)")
    _add_exec_flags(p)


def _add_sampling_flags(p: argparse.ArgumentParser, *, temperature: float = 0.0) -> None:
    # Sampling: llama.cpp's chain as Llama.create_completion builds it, with its defaults — except
    # the temperature of `generate`, 0 (greedy): it is how a route is checked against the whole
    # model, and a README run prints the text it shows. --temperature 0.8 is Llama's default.
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 = greedy; > 0 samples (default {temperature:g}; Llama's completion default is 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (0 = off; default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus cut-off in [0, 1] (1 = off; default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens below this x the top probability, in [0, 1] (0 = off; default 0.05)")
    p.add_argument("--typical-p", type=float, default=1.0, help="locally typical sampling in [0, 1] (1 = off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="> 0: penalize tokens seen in the last 64 generated (1 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract count x this (0 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtract this once seen (0 = off)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the text before the first occurrence of TEXT (repeat for several)")
    p.add_argument("--seed", type=int, default=None,
                   help="the sampler's seed, 0..4294967294 (default: a random one, printed on stderr)")


# -- parser ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--layer`` is not ``--layers``), and a usage error is one line.

    Subparsers are made by ``type(parent)`` (argparse's ``parser_class``), so
    every subcommand's parser is one of these too.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"meshnode: error: {errors.InputError.code}: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="meshnode", description="Run a GGUF model split by layer ranges across nodes.")
    ap.add_argument("--version", action="version", version=f"meshnode {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp and debug logs")
    ap.add_argument("--log-json", action="store_true", help="logs as JSON lines (the default under systemd)")
    sub = ap.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="the default model and range artifacts")
    msub = model.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", help="download and verify a model from the registry (default: "
                                        "SmolLM2-135M-Instruct Q4_1)")
    pull.add_argument("name", nargs="?", help="smollm2-135m (the default) or gemma3-270m")
    pull.add_argument("--force", action="store_true", help="download again even if cached")
    pull.set_defaults(func=cmd_model_pull)
    sl = msub.add_parser("slice", help="cut a layer range artifact (done once, then cached)")
    sl.add_argument("--model", help="GGUF file (default: the default model)")
    sl.add_argument("--layers", required=True, help="A:B, layers A..B-1")
    sl.set_defaults(func=cmd_model_slice)
    ins = msub.add_parser("inspect", help="what a GGUF is and where it can be cut exactly (metadata only)")
    ins.add_argument("file", help="GGUF file")
    ins.add_argument("--json", action="store_true", help="the description as JSON")
    ins.set_defaults(func=cmd_model_inspect)
    mid = msub.add_parser("id", help="the model id of a GGUF: the sha256 of its manifest (every tensor's "
                                     "sha256), what nodes, attestations and --mesh name it by")
    mid.add_argument("file", help="GGUF file")
    mid.add_argument("--manifest", action="store_true", help="print the manifest (canonical JSON) instead")
    mid.set_defaults(func=cmd_model_id)
    ls = msub.add_parser("ls", help="model files, fetched models and ranges in the cache: sizes, ids, served")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_model_ls)
    rm = msub.add_parser("rm", help="remove a model's ranges, fetched copy and files from the cache (not what a "
                                    "running node serves)")
    rm.add_argument("target", help="a model id prefix (8+ hex digits) or a path `model ls` shows")
    rm.add_argument("--ranges", action="store_true", help="only the cut ranges")
    rm.set_defaults(func=cmd_model_rm)
    gc = msub.add_parser("gc", help="remove unserved ranges and fetched models, least recently used first")
    gc.add_argument("--limit", type=float, required=True, metavar="GB", help="what they may take in all")
    gc.set_defaults(func=cmd_model_gc)

    for name, text in (("serve", "serve one layer range"),
                       ("join", "start a node and announce it to the mesh (--tracker / --mdns), or --auto")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", metavar="FILE", help="TOML file with these settings (docs/operations.md)")
        p.add_argument("--model", help="source GGUF file (default: the default model)")
        p.add_argument("--mesh", metavar="NAME_OR_ID",
                       help="no file here: fetch what the range needs of the model NAME names (file name, "
                            "general.name, or 8+ hex digits of its model id) from the nodes that serve it, found "
                            "with --tracker / --mdns; each piece checked against the model id (docs/fetch.md)")
        p.add_argument("--layers", help="A:B, layers A..B-1")
        p.add_argument("--listen", help="HOST:PORT (port 0 = any free port; default 127.0.0.1:0)")
        p.add_argument("--state-dir", help="where the node key and lock live (default: ~/.local/state/meshnode, "
                                           "or its nodes/HOST_PORT for a fixed --listen port)")
        p.add_argument("--mdns", metavar="ADDR", help="advertise and browse over mDNS on this interface address")
        p.add_argument("--tracker", metavar="URL", action="append",
                       help="register with this tracker (http://HOST:PORT; repeat: publish to each)")
        p.add_argument("--bootstrap", action="append", metavar="HOST:PORT",
                       help="a node to exchange directory records with first (repeat): how a node finds the mesh "
                            "when no tracker answers (docs/directory.md)")
        p.add_argument("--heartbeat", type=float, help="seconds between tracker heartbeats (default 10)")
        p.add_argument("--drain-timeout", type=float, help="seconds live sessions get when leaving (default 30)")
        p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at /metrics")
        p.add_argument("--api", metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible API (as `meshnode api`) over the mesh this node sees")
        p.add_argument("--api-key", metavar="KEY",
                       help="with --api: require 'Authorization: Bearer KEY' (needed off loopback; "
                            "or $MESHNODE_API_KEY)")
        p.add_argument("--api-tls", action="store_true",
                       help="with --api: serve it over HTTPS with a self-signed certificate kept in the state dir "
                            "(api-tls.crt; its sha256 is logged and in node.json's api entry)")
        p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
        p.add_argument("--max-opens-per-minute", type=float, metavar="N",
                       help="sessions one initiator may open here per minute, after a burst of 60 (default 600)")
        p.add_argument("--max-detached", type=int, metavar="N",
                       help="broken sessions kept for a resume at once (default: --max-sessions)")
        p.add_argument("--cache-limit", type=float, metavar="GB",
                       help="the cache's ranges and fetched models may take this much; unserved ones beyond it "
                            "are removed, least recently used first (default: no limit)")
        p.add_argument("--share-rate", type=float, metavar="MIB_PER_S",
                       help="MiB a second this node sends to peers fetching the model from it (default 64; 0: none)")
        p.add_argument("--no-link", action="store_true",
                       help="a Session stream of its own to the next hop for each session, not one link bundling "
                            "them (for comparison: docs/protocol.md, \"Links\")")
        if name == "join":
            p.add_argument("--auto", action="store_true", help="take the range whose coverage is weakest")
            p.add_argument("--span", type=int, help="with --auto: the most layers to take (default: the longest "
                                                    "stretch nobody serves, else half the model)")
            p.add_argument("--memory", type=float, metavar="GB",
                           help="with --auto: this node's memory budget; it takes no more layers than their "
                                "weights fit in three quarters of it (default: 0.8 of what the machine or its "
                                "cgroup has available)")
        p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction,
                       help="weights read into memory and the KV cache in transparent huge pages, where the kernel "
                            "gives them only when asked (THP 'madvise'; default: on, the node starts itself again "
                            "with glibc.malloc.hugetlb=1; docs/performance.md, 'Weights in huge pages')")
        _add_exec_flags(p)
        p.set_defaults(func=cmd_serve, join=name == "join")

    lv = sub.add_parser("leave", help="drain a local node and take it out of the mesh (exit 0 once gone)")
    _add_node_choice(lv, "the node")
    lv.add_argument("--all", action="store_true", help="every node running under the default state dir")
    lv.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to be gone")
    lv.set_defaults(func=cmd_leave)
    st = sub.add_parser("status", help="the local nodes (all those under the default state dir) and their mesh")
    _add_node_choice(st, "only the node")
    st.add_argument("--wait", type=float, metavar="SECONDS",
                    help="wait up to SECONDS until the nodes named (at least one) serve")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    gen = sub.add_parser("generate", help="generate text across a route, or with the whole model here")
    _add_route_flags(gen)
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="raw completion text")
    what.add_argument("--chat", metavar="MESSAGE",
                      help="a user message, rendered with the model's own chat template (as create_chat_completion)")
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    gen.add_argument("--max-tokens", type=int, default=32)
    _add_sampling_flags(gen)
    gen.add_argument("--stream", action="store_true",
                     help="print each token as it arrives (with --json: one JSON line per token, then the result)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal, over a route or the whole model here")
    _add_route_flags(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=512, help="most tokens per answer (default 512)")
    _add_sampling_flags(chat, temperature=0.2)  # Llama.create_chat_completion's default
    chat.set_defaults(func=cmd_chat)

    ident = sub.add_parser("id", help="print this node's id (makes its Ed25519 key on first use)")
    ident.add_argument("--state-dir", help="where the node key lives (default: ~/.local/state/meshnode)")
    ident.add_argument("--listen", metavar="HOST:PORT", help="the id of the node started with this fixed --listen "
                                                              "and no --state-dir (its own state dir)")
    ident.add_argument("--json", action="store_true", help="also print the public key")
    ident.set_defaults(func=cmd_id)

    peers = sub.add_parser("peers", help="list the peers found over mDNS (attestations verified)")
    peers.add_argument("--mdns", metavar="ADDR", required=True, help="interface address to browse on")
    peers.add_argument("--wait", type=float, default=3.0, help="seconds to browse")
    peers.add_argument("--json", action="store_true")
    peers.set_defaults(func=cmd_peers)

    api = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API over the mesh (a gateway: no layers)")
    api.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (default 127.0.0.1:8080)")
    api.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                     help="a node to route through (repeat; any order: every one is a candidate hop)")
    api.add_argument("--tracker", metavar="URL", action="append",
                     help="find the mesh's nodes on this tracker (repeat: all asked, any one is enough)")
    api.add_argument("--mdns", metavar="ADDR", help="find the mesh's nodes over mDNS on this interface address")
    api.add_argument("--api-key", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' (required off loopback; or $MESHNODE_API_KEY)")
    api.add_argument("--insecure", action="store_true",
                     help=INSECURE_HELP + "; also allows plain HTTP off loopback")
    api.add_argument("--tls", action="store_true",
                     help="serve HTTPS with a self-signed certificate made once and kept (its sha256 is printed)")
    api.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM; with --tls-key)")
    api.add_argument("--tls-key", metavar="FILE", help="the certificate's private key (PEM)")
    api.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                     help="cut a request that takes longer with 504 (default 600)")
    api.add_argument("--draft", choices=["none", "ngram"], default="none",
                     help="speculative decoding for every request that does not say (its 'draft' field): the "
                          "text is the text without drafting (default none)")
    api.add_argument("--draft-max", type=int, default=8, metavar="K",
                     help="the most tokens one step drafts (default 8; a request's 'draft_max' wins)")
    api.set_defaults(func=cmd_api)

    ver = sub.add_parser("verify-evidence", help="check a report that a hop lied, by recomputing its range "
                         "(exit 0: confirmed, 1: refuted, 2: malformed, 3: not verifiable with this model)")
    ver.add_argument("file", metavar="FILE", help="a serialized SignedEnvelope of an Evidence")
    ver.add_argument("--model", required=True, metavar="GGUF", help="the model the evidence is about")
    ver.add_argument("--json", action="store_true", help="print one JSON object")
    ver.set_defaults(func=cmd_verify_evidence)

    demo = sub.add_parser("demo", help="start a two-hop local route on the default model and generate")
    demo.add_argument("--prompt", default="The three primary colors are")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    from meshnode.runtime import logs

    logs.setup(verbose=ns.verbose, json_lines=True if ns.log_json else None)
    try:
        if ns.func is not cmd_serve:  # serve merges --insecure with its --config file first
            _configure_security(ns)
        return int(ns.func(ns))
    except errors.MeshnodeError as e:
        return _report(e)
    except BaseExceptionGroup as group:
        # trio nurseries wrap errors in groups: report the typed one they carry
        typed = errors.typed_leaf(group)
        if typed is None:
            raise
        return _report(typed)
    except KeyboardInterrupt:
        return 130


def _report(e: errors.MeshnodeError) -> int:
    print(f"meshnode: error: {e}", file=sys.stderr)
    return 2 if isinstance(e, errors.InputError) else 1




if __name__ == "__main__":
    sys.exit(main())
