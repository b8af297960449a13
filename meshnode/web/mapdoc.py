"""What the mesh map draws, as pure functions: routes in use from the heads' reports, models' coverage.

The tracker (tracker/views.py) and the API's map (meshnode/api/mapview.py)
both answer a status document of this shape, which ``static/map.js`` draws:

    models: [{fingerprint, name, n_layer, nodes, dead, misbehaving, replicas, gaps, covered, ...}]
    nodes:  [{node_id, range, alive, misbehaving, live_sessions, tokens_total, ...}]
    routes: [{model, hops: [node_id, ...], sessions}]

A route in use is what a head hop reported (``HealthReply.routes``): a node's
own claim. ``routes`` keeps only what could be true of the nodes the reader
knows: a route starts at its reporter, every hop is a known node of the
reporter's model, no hop twice, each hop's range starting where the previous
one's ends, from layer 0; it reads at most ``MAX_ROUTES_READ`` entries of a
report, of at most ``MAX_HOPS`` hops, and caps the session counts. Anything
else is dropped, never shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshnode.proto import node_pb2 as pb
from meshnode.routing.assign import coverage

#: entries of one node's report read at most (a node sends at most 32: meshnode/session/inuse.py)
MAX_ROUTES_READ = 32
#: hops a route may have (more: dropped, as a node cuts its own at this length)
MAX_HOPS = 64
#: sessions one route entry counts at most (more is a lie: no node holds that many)
MAX_SESSIONS = 4096
#: routes a status document lists at most (the busiest)
MAX_ROUTES_SHOWN = 256
#: layers a model is drawn with at most (n_layer is a node's claim)
MAX_LAYERS = 1024


@dataclass(frozen=True)
class Known:
    """What the reader knows of one node, to check a route through it."""

    #: the model fingerprint it serves
    model: str
    #: its layer range [start, end)
    start: int
    end: int


def valid_hops(reporter: str, hops: Sequence[str], known: Mapping[str, Known]) -> bool:
    """Whether a reported route could be real: it starts at its reporter, at layer 0; every hop is a known
    node of the reporter's model, none twice; each range starts where the previous one ends."""
    if not 1 <= len(hops) <= MAX_HOPS or hops[0] != reporter or len(set(hops)) != len(hops):
        return False
    head = known.get(reporter)
    if head is None or head.start != 0:
        return False
    at = 0
    for h in hops:
        k = known.get(h)
        if k is None or k.model != head.model or k.start != at:
            return False
        at = k.end
    return True


def routes(reports: Iterable[tuple[str, Sequence[pb.RouteInUse]]], known: Mapping[str, Known]) -> list[dict[str, Any]]:
    """The routes in use: from each (reporter, its HealthReply.routes) the valid entries (``valid_hops``;
    sessions >= 1, capped), one per distinct route (a route reported twice keeps its larger count), the
    busiest first, at most MAX_ROUTES_SHOWN."""
    found: dict[tuple[str, ...], int] = {}
    for reporter, entries in reports:
        for entry in list(entries[:MAX_ROUTES_READ]):
            hops = tuple(entry.hops[:MAX_HOPS + 1])
            if entry.sessions < 1 or not valid_hops(reporter, hops, known):
                continue
            found[hops] = max(found.get(hops, 0), min(int(entry.sessions), MAX_SESSIONS))
    return _listed(found, known)


def merge(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two lists of routes in use as one: a route in both keeps the larger count (the same sessions
    seen twice, e.g. by their head and by the gateway that opened them)."""
    found: dict[tuple[str, ...], int] = {}
    model: dict[tuple[str, ...], str] = {}
    for r in (*a, *b):
        key = tuple(r["hops"])
        found[key] = max(found.get(key, 0), int(r["sessions"]))
        model[key] = str(r["model"])
    return [{"model": model[k], "hops": list(k), "sessions": n}
            for k, n in sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))][:MAX_ROUTES_SHOWN]


def _listed(found: Mapping[tuple[str, ...], int], known: Mapping[str, Known]) -> list[dict[str, Any]]:
    busiest = sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_ROUTES_SHOWN]
    return [{"model": known[hops[0]].model, "hops": list(hops), "sessions": n} for hops, n in busiest]


def gaps(replicas: Sequence[int]) -> list[list[int]]:
    """The runs of layers no live node serves, as [start, end) pairs."""
    out: list[list[int]] = []
    for i, n in enumerate(replicas):
        if n:
            continue
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def models(nodes: Sequence[dict[str, Any]], max_rows: int = 64) -> list[dict[str, Any]]:
    """Per model (by name): its nodes (at most ``max_rows`` listed, live ones first), the dead and
    misbehaving among them, live replicas per layer, the gaps; dead and misbehaving nodes cover nothing."""
    by_fp: dict[str, list[dict[str, Any]]] = {}
    for n in sorted(nodes, key=lambda n: (bool(n.get("misbehaving")), not n["alive"], n["node_id"])):
        by_fp.setdefault(n["model"], []).append(n)
    out = []
    for fp, ns in by_fp.items():
        n_layer = min(int(ns[0]["n_layer"]), MAX_LAYERS)
        serving = [n for n in ns if n["alive"] and not n.get("misbehaving")]
        cov = coverage([(n["node_id"], n["range"][0], n["range"][1]) for n in serving], n_layer)
        replicas = [len(layer) for layer in cov]
        rows = [n["node_id"] for n in ns[:max_rows]]
        out.append({"fingerprint": fp, "name": ns[0]["model_name"], "n_layer": n_layer, "nodes": rows,
                    "dead": [n["node_id"] for n in ns[:max_rows] if not n["alive"]],
                    "misbehaving": [n["node_id"] for n in ns[:max_rows] if n.get("misbehaving")],
                    "node_count": len(ns), "dead_count": sum(not n["alive"] for n in ns),
                    "misbehaving_count": sum(bool(n.get("misbehaving")) for n in ns),
                    "replicas": replicas, "gaps": gaps(replicas), "covered": not gaps(replicas),
                    "active_sessions": route_sessions(serving, n_layer)})
    return sorted(out, key=lambda m: (m["name"], m["fingerprint"]))


def route_sessions(nodes: Sequence[dict[str, Any]], n_layer: int) -> int:
    """Sessions running through a model: every one runs each layer on one hop, so each layer's nodes
    hold them all; the smallest such sum over the layers (0 where a layer is uncovered)."""
    per_layer = [0] * n_layer
    for n in nodes:
        for i in range(max(0, n["range"][0]), min(n_layer, n["range"][1])):
            per_layer[i] += int(n.get("live_sessions", 0))
    return min(per_layer, default=0)
