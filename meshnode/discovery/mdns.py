"""mDNS discovery: advertise ``_meshnode._tcp.local.`` and browse for others.

Each node registers a service named by its node id, carrying ``node_id`` in
its TXT record. A browser resolves each service it sees, fetches the node's
capability over gRPC, verifies its signed attestation (a peer whose
attestation does not hold is never added), and feeds a ``PeerTable``; a
service that goes away (a node that leaves sends mDNS goodbyes, RFC 6762
§10.1) is removed, and entries not refreshed within the TTL expire.

zeroconf runs its own asyncio loop on a thread and calls handlers there;
they reach trio only through a memory channel, with the trio token
(``trio.from_thread``). Interfaces are explicit: tests and benchmarks bind
127.0.0.1 only, never every interface.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from zeroconf import ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from meshnode import errors
from meshnode.discovery.table import Event, Gone, PeerEntry, Seen, apply, expire
from meshnode.identity.attest import check_attested
from meshnode.transport.aiothread import AioRun, via_trio_asyncio
from meshnode.transport.client import get_capability, health

log = logging.getLogger("meshnode.discovery")

SERVICE_TYPE = "_meshnode._tcp.local."


@dataclass
class PeerTable:
    """The live table; mutated only through ``apply``/``expire``."""

    ttl: float = 30.0
    peers: dict[str, PeerEntry] = field(default_factory=dict)
    #: mDNS service name -> node id, to map removals back
    names: dict[str, str] = field(default_factory=dict)
    changed: trio.Event = field(default_factory=trio.Event)

    def feed(self, event: Event) -> None:
        self.peers = apply(self.peers, event, time.time())
        self.changed.set()
        self.changed = trio.Event()

    def live(self) -> dict[str, PeerEntry]:
        self.peers = expire(self.peers, time.time(), self.ttl)
        return dict(self.peers)


class _Zeroconf(Zeroconf):
    """Zeroconf whose own loop thread runs a plain asyncio loop.

    trio-asyncio installs a process-wide event loop policy; zeroconf's loop
    thread would get a trio-asyncio loop from ``asyncio.new_event_loop()``,
    which cannot be closed from another thread. This is zeroconf's
    ``_start_thread`` with the loop type made explicit.
    """

    def _start_thread(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.SelectorEventLoop()
            asyncio.set_event_loop(self.loop)
            self.engine.setup(self.loop, ready)
            self.loop.run_forever()

        self._loop_thread = threading.Thread(target=run, daemon=True, name="zeroconf")
        self._loop_thread.start()
        ready.wait()


def service_info(node_id: str, endpoint: str) -> ServiceInfo:
    host, port = endpoint.rsplit(":", 1)
    return ServiceInfo(
        SERVICE_TYPE,
        f"{node_id}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton(host)],
        port=int(port),
        properties={"node_id": node_id, "v": "1"},
        server=f"{node_id}.local.",
    )


async def _resolve(zc: Zeroconf, name: str) -> tuple[str, str] | None:
    info = await trio.to_thread.run_sync(zc.get_service_info, SERVICE_TYPE, name, 3000)
    if info is None or not info.parsed_addresses() or not info.port:
        return None
    node_id = ((info.properties or {}).get(b"node_id") or b"").decode()
    return node_id, f"{info.parsed_addresses()[0]}:{info.port}"


async def _learn(zc: Zeroconf, name: str, table: PeerTable, self_id: str, aio: AioRun) -> None:
    found = await _resolve(zc, name)
    if found is None:
        return
    node_id, endpoint = found
    if node_id == self_id:
        return
    try:
        cap = await aio(get_capability, endpoint, 5.0, node_id or None)  # TLS pinned to the advertised id
        check_attested(endpoint, cap, int(time.time()))
        if cap.node_id != node_id:
            raise errors.AttestationMismatchError(f"advertised as {node_id} but attests {cap.node_id}", hop=endpoint)
    except errors.MeshnodeError as e:
        log.warning("ignoring mDNS peer %s: %s", name, e)
        return
    table.names[name] = node_id
    table.feed(Seen(PeerEntry(node_id, endpoint, cap, "mdns", time.time())))


async def _keep_alive(table: PeerTable, aio: AioRun) -> None:
    """Liveness: re-probe every known mDNS peer each ttl/3; one that stops answering is dropped.

    mDNS removal notices are best effort (a crashed node sends no goodbye), so
    the table does not rely on them alone.
    """
    while True:
        await trio.sleep(table.ttl / 3)
        for entry in list(table.peers.values()):
            if entry.source != "mdns":
                continue
            try:
                await aio(health, entry.endpoint, 3.0, entry.node_id)
            except errors.MeshnodeError:
                table.feed(Gone(entry.node_id))
                continue
            table.feed(Seen(entry))


async def run_mdns(table: PeerTable, *, interface: str, node_id: str = "", endpoint: str | None = None,
                   aio: AioRun = via_trio_asyncio,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Advertise (if ``endpoint``) and browse until cancelled. Peers are probed over gRPC through
    ``aio`` (default: a trio-asyncio loop, which the caller opens; a node passes its asyncio thread).

    On cancellation the service is unregistered (goodbye packets) and
    zeroconf closed, within a shielded, bounded cleanup.
    """
    zc = await trio.to_thread.run_sync(lambda: _Zeroconf(interfaces=[interface]))
    info = service_info(node_id, endpoint) if endpoint else None
    send, recv = trio.open_memory_channel[tuple[str, ServiceStateChange]](256)
    token = trio.lowlevel.current_trio_token()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        try:
            trio.from_thread.run_sync(send.send_nowait, (name, state_change), trio_token=token)
        except (trio.RunFinishedError, trio.WouldBlock, trio.ClosedResourceError):
            pass

    browser: ServiceBrowser | None = None
    try:
        if info is not None:
            await trio.to_thread.run_sync(zc.register_service, info)
        handlers: list[Callable[..., None]] = [on_change]
        browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=handlers)
        task_status.started()
        async with trio.open_nursery() as nursery, recv:
            nursery.start_soon(_keep_alive, table, aio)
            async for name, change in recv:
                if change in (ServiceStateChange.Added, ServiceStateChange.Updated):
                    nursery.start_soon(_learn, zc, name, table, node_id, aio)
                elif change is ServiceStateChange.Removed and name in table.names:
                    table.feed(Gone(table.names.pop(name)))
    finally:
        with trio.move_on_after(5, shield=True):
            if browser is not None:
                await trio.to_thread.run_sync(browser.cancel)
            if info is not None:
                await trio.to_thread.run_sync(zc.unregister_service, info)
            await trio.to_thread.run_sync(zc.close)
