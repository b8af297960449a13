"""Joining, leaving and looking at the mesh: ``meshnode join`` / ``leave`` / ``status``."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from meshnode import errors
from meshnode.discovery.tracker_client import urls_of
from meshnode.gguf.model import fingerprint, inspect_model
from meshnode.http.client import request, tracker_url
from meshnode.routing.assign import coverage
from meshnode.runtime.nodes import Running, find_nodes, probe
from meshnode.transport.aiothread import AioThread, open_aio_thread
from meshnode.transport.client import get_capability, health


def replicas_per_layer(ranges: list[tuple[int, int]], n_layer: int) -> list[int]:
    """How many of ``ranges`` serve each layer. Pure."""
    return [len(ids) for ids in coverage([("", a, b) for a, b in ranges], n_layer)]


def node_memory(memory_gb: float | None) -> int:
    """A node's memory budget: ``--memory`` GB, else a share of what the machine or its cgroup has left."""
    from meshnode.executor.cpus import available_memory
    from meshnode.routing.sizing import DEFAULT_SHARE

    if memory_gb is not None:
        if memory_gb <= 0:
            raise errors.InputError("--memory is GB, more than 0")
        return int(memory_gb * 1e9)
    return int(available_memory() * DEFAULT_SHARE)


def auto_range(model: Path, span: int, *, tracker: str | None, mdns: str | None,
               memory: int) -> tuple[int, int, float]:
    """The range a joining node should take: as many layers as ``memory`` holds and this machine's speed
    merits (``span`` at most, if given), where the mesh covers least (routing/sizing.py); and that speed
    relative to the mesh's nodes."""
    from meshnode.executor.probe import step_time
    from meshnode.fetch.join import find_holders
    from meshnode.gguf.meta import read_meta
    from meshnode.routing.sizing import layer_bytes, peer_steps, relative_speed, sized_range

    if not tracker and not mdns:
        raise errors.InputError("--auto needs to see the mesh: give --tracker URL and/or --mdns ADDR")
    n_layer = inspect_model(model).n_layer
    holders = trio.run(functools.partial(find_holders, fingerprint(model), tracker=tracker, mdns=mdns,
                                         timeout=2.0, required=False))
    weights = layer_bytes([(t.name, t.n_bytes) for t in read_meta(model).tensors], n_layer)
    speed = (relative_speed(step_time(model, n_layer, list(weights.per)), peer_steps(weights, holders.step_times))
             if holders.peers else 1.0)
    return (*sized_range(replicas_per_layer(holders.ranges, n_layer), weights, memory, span, speed), speed)


def select(base: Path, state_dir: Path | None, listen: list[str], *, every: bool) -> list[Running]:
    """The running nodes ``leave``/``status`` act on: the one holding ``state_dir``; else, among the
    nodes under the default ``base`` (runtime.find_nodes), those listening on ``listen``; else all
    of them with ``every``, else the only one. One-line InputErrors otherwise."""
    if state_dir is not None:
        if listen:
            raise errors.InputError("give --state-dir or --listen (a node under the default state dir), not both")
        one = probe(state_dir)
        if one is None:
            raise errors.InputError(f"no node is running with state dir {state_dir}")
        return [one]
    found = find_nodes(base)
    if listen:
        missing = [a for a in listen if not any(r.matches(a) for r in found)]
        if missing:
            raise errors.InputError(f"no node listening on {', '.join(missing)} runs under {base}" + _known(found))
        return [r for r in found if any(r.matches(a) for a in listen)]
    if not found:
        raise errors.InputError(f"no node is running under state dir {base} (started elsewhere? give --state-dir)")
    if len(found) > 1 and not every:
        raise errors.InputError(f"{len(found)} nodes run under {base}{_known(found)}: "
                                "give --listen HOST:PORT, --state-dir DIR or --all")
    return found


def _known(found: list[Running]) -> str:
    return f" ({'; '.join(r.describe() for r in found)})" if found else ""


def leave(nodes: list[Running], timeout: float) -> list[Running]:
    """Ask each node to leave (SIGTERM, all at once) and wait until each has let go of its state dir.

    Only a node that serves is signalled: its pid is then in node.json, written by the lock's
    holder itself (the lock file's pid alone may still be its predecessor's for a moment)."""
    starting = [r for r in nodes if r.info is None]
    if starting:
        raise errors.InputError(f"still starting: {'; '.join(r.describe() for r in starting)} "
                                f"in {starting[0].state_dir}; wait for it (status --wait SECONDS), then leave")
    for r in nodes:
        os.kill(r.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in nodes:
        while probe(r.state_dir) is not None:
            if time.monotonic() > deadline:
                raise errors.PeerError(f"node {r.describe()} did not leave within {timeout:.0f}s")
            time.sleep(0.1)
    return nodes


def wait_serving(select_them: Callable[[], list[Running]], timeout: float) -> list[Running]:
    """``select_them()`` once every node it returns serves (has written node.json); bounded by ``timeout``.

    Until then, the InputError of a node not found (not started yet) or the nodes still starting
    are retried; at the deadline, the last error stands."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            nodes = select_them()
            if all(r.info is not None for r in nodes):
                return nodes
            late: errors.MeshnodeError = errors.InputError(
                f"still starting after {timeout:.0f}s: {'; '.join(r.describe() for r in nodes if r.info is None)}")
        except errors.InputError as e:
            late = e
        if time.monotonic() > deadline:
            raise late
        time.sleep(0.2)


def status(nodes: list[Running]) -> dict[str, Any]:
    """These nodes, and the mesh as they see it (their trackers)."""

    async def one(r: Running, aio: AioThread) -> dict[str, Any]:
        if r.info is None:
            return {"state_dir": str(r.state_dir), "pid": r.pid, "starting": True}
        endpoint = str(r.info["endpoint"])
        try:
            nid, plain = r.info.get("node_id") or None, bool(r.info.get("insecure"))  # as the node says it serves
            cap = await aio.run(functools.partial(get_capability, endpoint, 5.0, nid, plaintext=plain))
            h = await aio.run(functools.partial(health, endpoint, 5.0, nid, plaintext=plain))
        except errors.MeshnodeError as e:
            return {"state_dir": str(r.state_dir), "pid": r.pid, "endpoint": endpoint, "error": str(e)}
        return {"node_id": cap.node_id, "endpoint": endpoint, "listen": r.info.get("listen"),
                "state_dir": str(r.state_dir), "pid": r.pid, "range": [cap.range.start, cap.range.end],
                "role": cap.role, "model": cap.model_fingerprint, "serving": h.serving,
                "live_sessions": h.live_sessions, "free_sessions": h.free_sessions,
                "steps_total": h.steps_total, "tracker": r.info.get("tracker"), "mdns": r.info.get("mdns")}

    async def gather() -> dict[str, Any]:
        async with open_aio_thread() as aio:
            rows = [await one(r, aio) for r in nodes]
        peers: list[dict[str, Any]] = []
        for tracker, model in sorted({(url, n["model"]) for n in rows for url in urls_of(n.get("tracker"))}):
            try:
                peers += await _tracker_peers(tracker, model)
            except errors.MeshnodeError:
                continue  # one tracker down: the others still say
        once = {p["node_id"]: p for p in reversed(peers)}  # a node several trackers list: once
        return {"nodes": rows, "peers": [p for p in peers if once.get(p["node_id"]) is p]}

    return trio.run(gather)


@contextlib.contextmanager
def _garbled(url: str) -> Iterator[None]:
    """A tracker answer that is not meshnode's JSON is the tracker's fault: PeerError naming it."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise errors.PeerError(f"the tracker's answer is not meshnode's JSON: {e!r}", hop=url) from None


async def _tracker_peers(tracker: str, model: str) -> list[dict[str, Any]]:
    st, body = await request(tracker_url(tracker, "/api/status"))
    if st != 200:
        return []
    with _garbled(tracker):
        keys = ("node_id", "endpoints", "range", "role", "alive", "live_sessions", "free_sessions",
                "decode_tokens_per_second")
        return [{k: n[k] for k in keys} | {"source": "tracker", "tracker": tracker}
                for n in json.loads(body)["nodes"] if n["model"] == model]
