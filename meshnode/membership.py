"""Joining, leaving and looking at the mesh: ``meshnode join`` / ``leave`` / ``status``."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from meshnode import errors
from meshnode.discovery.mdns import PeerTable, run_mdns
from meshnode.gguf.model import fingerprint, inspect_model
from meshnode.httpclient import request
from meshnode.node import RuntimeFile
from meshnode.routing.assign import coverage, weakest_range
from meshnode.transport.aiothread import open_aio_thread
from meshnode.transport.client import get_capability, health


def replicas_per_layer(ranges: list[tuple[int, int]], n_layer: int) -> list[int]:
    """How many of ``ranges`` serve each layer. Pure."""
    return [len(ids) for ids in coverage([("", a, b) for a, b in ranges], n_layer)]


async def _tracker_ranges(url: str, fp: str) -> list[tuple[int, int]]:
    status, body = await request(url.rstrip("/") + "/api/lookup?" + urllib.parse.urlencode({"model": fp}))
    if status != 200:
        raise errors.PeerError(f"tracker lookup failed with HTTP {status}", hop=url)
    with _garbled(url):
        return [(int(n["range"][0]), int(n["range"][1])) for n in json.loads(body)["nodes"] if n.get("alive")]


@contextlib.contextmanager
def _garbled(url: str) -> Iterator[None]:
    """A tracker answer that is not meshnode's JSON is the tracker's fault: PeerError naming it."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise errors.PeerError(f"the tracker's answer is not meshnode's JSON: {e!r}", hop=url) from None


async def _mdns_ranges(interface: str, fp: str, wait: float = 2.0) -> list[tuple[int, int]]:
    table = PeerTable()
    async with open_aio_thread() as aio, trio.open_nursery() as nursery:
        await nursery.start(functools.partial(run_mdns, table, interface=interface, aio=aio.run))
        await trio.sleep(wait)
        nursery.cancel_scope.cancel()
    return [(p.capability.range.start, p.capability.range.end) for p in table.live().values()
            if p.capability.model_fingerprint == fp]


def auto_range(model: Path, span: int, *, tracker: str | None, mdns: str | None) -> tuple[int, int]:
    """The range a joining node should take: the weakest-covered window of ``span`` layers."""
    if not tracker and not mdns:
        raise errors.InputError("--auto needs to see the mesh: give --tracker URL and/or --mdns ADDR")
    n_layer = inspect_model(model).n_layer
    fp = fingerprint(model)

    async def gather() -> list[tuple[int, int]]:
        ranges: list[tuple[int, int]] = []
        if tracker:
            ranges += await _tracker_ranges(tracker, fp)
        if mdns:
            ranges += await _mdns_ranges(mdns, fp)
        return ranges

    ranges = trio.run(gather)
    return weakest_range(replicas_per_layer(ranges, n_layer), span or n_layer // 2)


def leave(state_dir: Path, timeout: float) -> dict[str, Any]:
    """Ask the node running with ``state_dir`` to leave (SIGTERM) and wait until it is gone."""
    doc = RuntimeFile(state_dir).read()
    if doc is None:
        raise errors.InputError(f"no node is running with state dir {state_dir}")
    pid = int(str(doc["pid"]))
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and _alive(pid):
        if time.monotonic() > deadline:
            raise errors.PeerError(f"node {doc.get('node_id')} (pid {pid}) did not leave within {timeout:.0f}s")
        time.sleep(0.1)
    return doc


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has left already


def status(state_dir: Path) -> dict[str, Any]:
    """This node, and the mesh as it sees it (its tracker and/or mDNS)."""
    doc = RuntimeFile(state_dir).read()
    if doc is None:
        raise errors.InputError(f"no node is running with state dir {state_dir}")
    endpoint = str(doc["endpoint"])

    async def gather() -> dict[str, Any]:
        async with open_aio_thread() as aio:
            cap = await aio.run(get_capability, endpoint, 5.0)
            h = await aio.run(health, endpoint, 5.0)
        peers: list[dict[str, Any]] = []
        if doc.get("tracker"):
            st, body = await request(str(doc["tracker"]).rstrip("/") + "/api/status")
            if st == 200:
                with _garbled(str(doc["tracker"])):
                    peers += [{k: n[k] for k in ("node_id", "endpoints", "range", "role", "alive", "live_sessions",
                                                 "free_sessions", "decode_tokens_per_second")} | {"source": "tracker"}
                              for n in json.loads(body)["nodes"] if n["model"] == cap.model_fingerprint]
        return {
            "node": {"node_id": cap.node_id, "endpoint": endpoint, "range": [cap.range.start, cap.range.end],
                     "role": cap.role, "model": cap.model_fingerprint, "serving": h.serving,
                     "live_sessions": h.live_sessions, "free_sessions": h.free_sessions,
                     "steps_total": h.steps_total, "tracker": doc.get("tracker"), "mdns": doc.get("mdns")},
            "peers": peers,
        }

    return trio.run(gather)
