"""The composition root of a node: range artifact -> executor -> gRPC service.

One nursery holds every component; ``run_node`` reports the bound address
through ``task_status.started`` once the node really serves.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from meshnode.capabilities import capability, hardware, measure_throughput
from meshnode.directory.carried import CarriedDirectory
from meshnode.discovery.tracker_client import run_heartbeat, urls_of
from meshnode.executor import ExecConfig, RangeExecutor
from meshnode.fetch.limits import DEFAULT_RATE, ShareLimits
from meshnode.gguf.cutchild import cut_in_child
from meshnode.gguf.integrity import verify_artifact
from meshnode.gguf.model import check_file
from meshnode.gguf.slicer import RangeArtifact
from meshnode.identity import NodeIdentity, load_or_create, tlscert
from meshnode.proto import node_pb2 as pb
from meshnode.runtime.nodes import RuntimeDir, node_state_dir
from meshnode.runtime.sdnotify import notify, run_watchdog, watchdog_interval
from meshnode.session.hop import HopLimits
from meshnode.session.host import SessionHost
from meshnode.transport import security
from meshnode.transport.aiothread import AioThread, open_aio_thread
from meshnode.transport.server import check_listen, serve_grpc, split_hostport
from meshnode.transport.servicer import NodeServicer

if TYPE_CHECKING:
    from meshnode.fetch.share import Share

log = logging.getLogger("meshnode.node")


@dataclass(frozen=True)
class NodeConfig:
    #: the source GGUF the range is cut from
    model: Path
    #: first layer served
    start: int
    #: one past the last layer served
    end: int
    #: HOST:PORT to listen on; port 0 picks a free port
    listen: str = "127.0.0.1:0"
    #: llama.cpp settings; numerics ones must be equal on every hop
    executor: ExecConfig = field(default_factory=ExecConfig)
    #: per-session bounds this node proposes
    limits: HopLimits = field(default_factory=HopLimits)
    #: where the node's key, lock and node.json live (None: runtime.node_state_dir picks one)
    state_dir: Path | None = None
    #: advertise and browse over mDNS on this interface address (None: no mDNS)
    mdns_interface: str | None = None
    #: register with these trackers (http://HOST:PORT; one URL or several) and heartbeat to each (None: none)
    tracker: str | tuple[str, ...] | None = None
    #: seconds between tracker heartbeats
    heartbeat: float = 10.0
    #: seconds live sessions get to finish when the node leaves
    drain_timeout: float = 30.0
    #: HOST:PORT for Prometheus metrics at /metrics (None: off)
    metrics: str | None = None
    #: HOST:PORT for the OpenAI-compatible API over the mesh this node sees (None: off)
    api: str | None = None
    #: the Bearer key the API requires (None: none; required off loopback)
    api_key: str | None = None
    #: serve the API over HTTPS with a self-signed certificate kept in the state dir (api-tls.crt/.key)
    api_tls: bool = False
    #: plaintext streams, no TLS (``--insecure``: a closed lab network only)
    insecure: bool = False
    #: bytes a second this node sends to peers fetching the model from it (0: serves none)
    share_rate: int = DEFAULT_RATE
    #: bytes the cache's ranges and fetched models may take; unserved ones beyond it are removed (None: no limit)
    cache_limit: int | None = None
    #: nodes to exchange directory records with first (``--bootstrap HOST:PORT``; directory/carried.py)
    bootstrap: tuple[str, ...] = ()


def prepare(config: NodeConfig) -> RangeArtifact:
    """Validate the flags, the model and the range, cutting the range artifact if it is not cut yet
    (in a child process: gguf/cutchild.py)."""
    check_listen(config.listen)
    if config.metrics:
        split_hostport(config.metrics, "--metrics")
    check_file(config.model)
    return cut_in_child(config.model, config.start, config.end)


def prepare_verified(config: NodeConfig) -> RangeArtifact:
    """``prepare``, then check the bytes that will be loaded against the manifest; the range (and a
    fetched model's file) is then held as in use for this process's life (cache/inuse.py), and the
    cache limit, if any, applied to the rest."""
    from meshnode.cache import enforce, inuse
    from meshnode.fetch.join import is_fetched

    art = prepare(config)
    verify_artifact(art)
    inuse.hold(art.dir)
    if is_fetched(config.model):
        inuse.hold(config.model.parent)
    if config.cache_limit is not None:
        enforce(config.cache_limit)
    return art


async def run_node(config: NodeConfig, *, stop: trio.Event | None = None,
                   task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until ``stop`` is set (then drain and leave) or until cancelled.

    Draining: new sessions are refused, live ones get ``drain_timeout``
    seconds to finish, then mDNS and the tracker are told the node leaves
    (in the shielded cleanup of their tasks) and the server stops; the
    sessions still live then are cut, and their KV freed before the
    executor closes.
    """
    host, port = split_hostport(config.listen)
    sdir, hint = node_state_dir(config.state_dir, host, port)
    # the flags' and the model's own checks answer before the state dir's lock does
    artifact = await trio.to_thread.run_sync(prepare_verified, config)
    runtime = RuntimeDir(sdir)
    await trio.to_thread.run_sync(functools.partial(runtime.claim, hint=hint))
    try:
        ident = await trio.to_thread.run_sync(load_or_create, sdir)
        if config.insecure:
            security.configure(insecure=True)  # this process's clients (hop to hop) speak plaintext too
        tls = None if config.insecure else await trio.to_thread.run_sync(tlscert.load_or_create, sdir, ident)
        await _serve(config, artifact, ident, runtime, stop, task_status, tls)
    finally:
        runtime.release()


async def _serve(config: NodeConfig, artifact: RangeArtifact, ident: NodeIdentity, runtime: RuntimeDir,
                 stop: trio.Event | None, task_status: trio.TaskStatus[str],
                 tls: tuple[bytes, bytes] | None) -> None:
    """``run_node`` once the state dir is held: load the range, serve, drain."""
    executor = await trio.to_thread.run_sync(RangeExecutor, artifact, config.executor)
    try:
        hw = await trio.to_thread.run_sync(hardware, executor.config)
        tput = await trio.to_thread.run_sync(executor.run_blocking, measure_throughput)
        endpoints: list[str] = []

        def cap() -> pb.Capability:
            return capability(artifact, executor.config, config.limits, ident, hardware=hw, throughput=tput,
                              endpoints=endpoints, insecure=config.insecure)

        # the data plane (grpc.aio, sessions, the executor's waiters) runs on an asyncio loop of its own
        # thread; trio keeps the lifecycle and reaches that loop only through ``aio`` (aiothread.py)
        async with open_aio_thread() as aio, trio.open_nursery() as nursery:
            host = SessionHost(executor, cap, config.limits, endpoint=config.listen, ident=ident)
            share = await trio.to_thread.run_sync(_share, config, host) if config.share_rate > 0 else None
            directory = _directory(config, ident, host, runtime.dir, endpoints, artifact.fingerprint)
            servicer = NodeServicer(host, executor, share, directory)
            addr = await nursery.start(functools.partial(serve_grpc, servicer, config.listen, aio=aio.run, tls=tls))
            host.endpoint = addr
            endpoints.append(addr)
            host.capability = cap()
            metrics_url = None
            if config.metrics:
                mhost, mport = split_hostport(config.metrics)
                from meshnode.http.serve import serve_asgi  # hypercorn + starlette cost ~9 MB: only when used

                bound = await nursery.start(serve_asgi, host.metrics.asgi(), mhost, mport)
                metrics_url = f"http://{mhost}:{bound}/metrics"
                log.info("metrics on %s", metrics_url)
            await _announce(nursery, config, ident, host, aio, addr)
            await nursery.start(functools.partial(directory.run, functools.partial(_ask_records, aio),
                                                  _tracker_records(config, artifact.fingerprint),
                                                  config.bootstrap, interval=config.heartbeat))
            api_url = await _serve_api(nursery, config, aio, addr, runtime.dir) if config.api else None
            runtime.write(node_id=ident.node_id, listen=config.listen, endpoint=addr,
                          layers=f"{artifact.start}:{artifact.end}", tracker=config.tracker,
                          mdns=config.mdns_interface, metrics=metrics_url, api=api_url, insecure=config.insecure)
            log.info("serving %s layers %d:%d on %s", artifact.role.value, artifact.start, artifact.end, addr)
            notify("READY=1")
            interval = watchdog_interval()
            if interval:
                nursery.start_soon(run_watchdog, interval)
            nursery.start_soon(_sweep_detached, host, aio)
            task_status.started(addr)
            await (stop if stop is not None else trio.Event()).wait()
            await _drain(host, executor, aio, config.drain_timeout)
            nursery.cancel_scope.cancel()  # gRPC stops: the sessions still live are cut
            with trio.CancelScope(shield=True):
                await _settle(executor)
    finally:
        executor.close()


def _directory(config: NodeConfig, ident: NodeIdentity, host: SessionHost, sdir: Path,
               endpoints: list[str], model: str) -> CarriedDirectory:
    """The directory this node carries and exchanges with its peers (directory/carried.py)."""
    from meshnode.identity.advert import advertise

    def own() -> pb.SignedEnvelope:
        return advertise(ident, host.capability, host.health(), seq=time.time_ns(), now=int(time.time()),
                         ttl=max(int(3 * config.heartbeat), 30))

    return CarriedDirectory(sdir, model, ident.node_id, own, lambda: endpoints[0] if endpoints else "")


async def _ask_records(aio: AioThread, endpoint: str, req: pb.RecordsRequest) -> pb.RecordBatch:
    from meshnode.transport.client import records

    reply: pb.RecordBatch = await aio.run(records, endpoint, req)
    return reply


def _tracker_records(config: NodeConfig, model: str) -> Callable[[], Awaitable[list[pb.SignedEnvelope]]] | None:
    """What the trackers list for this node's model, for its directory (None: no tracker)."""
    if not config.tracker:
        return None
    from meshnode.discovery.tracker_client import ask_all, lookup_records

    async def ask() -> list[pb.SignedEnvelope]:
        return await ask_all(config.tracker, lambda url: lookup_records(url, model))

    return ask


def _share(config: NodeConfig, host: SessionHost) -> Share:
    """What this node serves of its model to peers that fetch it: the whole file, or the pieces it
    fetched itself (fetch/share.py)."""
    from meshnode.fetch.join import is_fetched
    from meshnode.fetch.share import Share
    from meshnode.fetch.store import PartialModel
    from meshnode.modelid import manifest_of

    manifest = manifest_of(config.model)
    have = None
    if is_fetched(config.model):
        part = PartialModel.open(manifest.model_id)
        have = part.have if part is not None else set()
        if part is not None:
            part.close()
    m = host.metrics
    share = Share(config.model, manifest, have, ShareLimits(rate=config.share_rate),
                  on_bytes=m.fetch_bytes.inc, on_refused=lambda code: m.fetch_refused.labels(code=code).inc())
    m.fetch_active.set_function(lambda: sum(share.admission.active.values()))
    return share


async def _serve_api(nursery: trio.Nursery, config: NodeConfig, aio: AioThread, addr: str, sdir: Path) -> str:
    """The API over the mesh this node sees: itself, its tracker, its mDNS; its sessions on ``aio``."""
    from meshnode.api import ApiConfig, MeshSource, run_api
    from meshnode.http.tls import self_signed

    assert config.api is not None
    host, _ = split_hostport(config.api)
    tls = None
    if config.api_tls:  # made once, kept beside the node's key (its sha256 is what clients pin)
        names = [host] if host not in ("0.0.0.0", "::", "") else []
        tls = await trio.to_thread.run_sync(self_signed, sdir, "api-tls", names)
    source = MeshSource(peers=(addr,), tracker=config.tracker, mdns=config.mdns_interface)
    api = ApiConfig(listen=config.api, api_key=config.api_key, insecure=config.insecure, tls=tls)
    bound = await nursery.start(functools.partial(run_api, api, source, aio=aio))
    url = f"{'https' if tls else 'http'}://{bound}/v1"
    log.info("API on %s%s", url, f" (certificate sha256={tls.fingerprint})" if tls else "")
    return url


async def _announce(nursery: trio.Nursery, config: NodeConfig, ident: NodeIdentity, sessions: SessionHost,
                    aio: AioThread, addr: str) -> None:
    """Start mDNS advertising and tracker heartbeats, as configured."""
    if config.mdns_interface:
        from meshnode.discovery.mdns import PeerTable, run_mdns  # zeroconf costs RSS: only when used

        host, port = split_hostport(addr)
        advertised = f"{config.mdns_interface}:{port}" if host in ("0.0.0.0", "::") else addr
        await nursery.start(functools.partial(run_mdns, PeerTable(), interface=config.mdns_interface,
                                              node_id=ident.node_id, endpoint=advertised, aio=aio.run))
    urls = urls_of(config.tracker)
    for url in urls:  # a tracker that is down does not stop the node: it is told at the next heartbeat it answers,
        # and meanwhile the node is found through the other trackers and the directory its peers carry
        await nursery.start(functools.partial(run_heartbeat, url, ident, lambda: sessions.capability,
                                              sessions.health, interval=config.heartbeat, required=False))


async def _sweep_detached(host: SessionHost, aio: AioThread, every: float = 1.0) -> None:
    """Free broken sessions' KV state once no resume came within the grace period."""
    while True:
        await trio.sleep(every)
        await aio.run(host.sweep)


async def _drain(host: SessionHost, executor: RangeExecutor, aio: AioThread, timeout: float) -> None:
    """Refuse new sessions; give live ones ``timeout`` seconds to finish."""
    notify("STOPPING=1")
    host.serving = False
    await aio.run(host.drop_detached)  # no resume is coming any more
    log.info("draining: %d live sessions, up to %.0fs", executor.live_slots, timeout)
    with trio.move_on_after(timeout):
        # slots are freed by asyncio-side session code; a bounded 100 ms poll is simpler
        # than a cross-library wake-up, and only runs while leaving
        while executor.live_slots:  # noqa: ASYNC110
            await trio.sleep(0.1)
    if executor.live_slots:
        log.warning("drain timeout: %d live sessions are cut when gRPC stops", executor.live_slots)
    else:
        log.info("drained: no live sessions")


async def _settle(executor: RangeExecutor, timeout: float = 8.0) -> None:
    """While gRPC stops (a 2 s grace, then it cancels the calls left): wait until the cut
    sessions' clean-up -- free the KV slot, close the downstream stream, on the asyncio
    loop -- has run, before that loop and the executor close (bounded)."""
    with trio.move_on_after(timeout):
        while executor.live_slots:  # noqa: ASYNC110 (as in _drain)
            await trio.sleep(0.05)
    log.info("left: %d sessions hold KV", executor.live_slots)
