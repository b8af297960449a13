"""What the tracker shows: pure functions from registry entries and probe results to JSON-able data."""

from __future__ import annotations

import base64
from typing import Any

from meshnode.routing.assign import coverage as layer_coverage
from meshnode.routing.assign import model_matches
from meshnode.web import mapdoc
from meshnode.web.mapdoc import Known
from meshnode.web.mapseries import Charted
from tracker.liveness import FAIL_LIMIT, ProbeState, alive, freshest, judge
from tracker.registry import Entry, Mark, Registry

#: layers a model is shown with at most: n_layer is the node's claim, and the coverage map is a list per layer
#: (the deepest models known have a few hundred)
MAX_LAYERS = 1024
#: nodes /api/status lists at most (live ones first; the rest are counted in "omitted")
MAX_NODES_SHOWN = 1000
#: models /api/status lists at most (those with a node the probes reached first)
MAX_MODELS_SHOWN = 100
#: nodes a model's card lists at most (its coverage counts every live node)
MAX_MODEL_ROWS = 64
#: nodes one /api/lookup answers with at most (those the probes reached first): routes need a few
MAX_LOOKUP = 256


def mark_view(m: Mark | None, now: float) -> dict[str, Any] | None:
    """Why a node is marked misbehaving (None: it is not): the lie a recomputation confirmed."""
    if m is None:
        return None
    return {"model": m.model, "range": list(m.range), "pos_start": m.pos_start, "reporter": m.reporter,
            "at_unix": round(m.at), "seconds_ago": round(max(0.0, now - m.at), 1), "evidence": m.evidence}


#: nodes caught lying /api/status lists at most (the latest first; all are kept and flagged on their entries)
MAX_MARKS_SHOWN = 100


def marks(registry: Registry, now: float) -> dict[str, Any]:
    """Every node id caught lying, registered now or not: the latest MAX_MARKS_SHOWN, and how many in all."""
    latest = sorted(registry.marks.values(), key=lambda m: m.at, reverse=True)[:MAX_MARKS_SHOWN]
    return {"count": len(registry.marks), "nodes": [{"node_id": m.node_id, **(mark_view(m, now) or {})}
                                                    for m in latest]}


def node_view(e: Entry, now: float, ttl: float, probe: ProbeState | None = None,
              fail_limit: int = FAIL_LIMIT, mark: Mark | None = None) -> dict[str, Any]:
    cap = e.advert.capability
    hw, tput = cap.hardware, cap.throughput
    verdict = judge(probe, e.last_seen, now, ttl, fail_limit)
    live = freshest(e.advert.health, e.last_seen, probe)
    h = live.health
    return {
        "node_id": e.node_id,
        "endpoints": list(cap.endpoints),
        "model": cap.model_fingerprint,
        "model_name": cap.model_name,
        "model_file": cap.model_file,
        "range": [cap.range.start, cap.range.end],
        "role": cap.role,
        "n_layer": cap.n_layer,
        # serves plaintext streams (--insecure): nothing it carries is private or pinned to its id
        "insecure": cap.insecure,
        # measured by the node at start, one session, warm (meshnode/capabilities.py)
        "decode_tokens_per_second": round(tput.decode_tokens_per_second, 1),
        "prefill_tokens_per_second": round(tput.prefill_tokens_per_second, 1),
        "cpu": hw.cpu_model,
        "cores": hw.cores,
        "cpu_features": list(hw.cpu_features),
        "memory_total_bytes": hw.memory_total_bytes,
        "devices": [{"name": d.name, "type": d.type, "description": d.description} for d in hw.devices],
        # headline figures: the node's HealthReply, from the tracker's last probe or its last heartbeat,
        # whichever is newer
        "serving": h.serving,
        "live_sessions": h.live_sessions,
        "free_sessions": h.free_sessions,
        "detached_sessions": h.detached_sessions,
        "tokens_total": h.tokens_total,
        "errors_total": h.errors_total,
        "step_ms_mean": round(h.step_seconds_mean * 1e3, 2),
        "steps_total": h.steps_total,
        "batches_total": h.batches_total,
        "mean_batch": mean_batch(h.steps_total, h.batches_total),
        "counters_source": live.source,
        "counters_age_seconds": round(max(0.0, now - live.at), 1),
        "max_sessions": cap.max_sessions,
        "last_seen_seconds_ago": round(max(0.0, now - e.last_seen), 1),
        "alive": verdict.alive,
        "liveness": "alive" if verdict.alive else "dead",
        "liveness_reason": verdict.reason,
        "liveness_by": verdict.by,
        # caught lying (a report the tracker verified by recomputation): listed, ranked last, covers nothing
        "misbehaving": mark is not None,
        "misbehaving_report": mark_view(mark, now),
        "probe": probe_view(probe, now),
        "envelope": base64.b64encode(e.envelope.SerializeToString()).decode(),
    }


def probe_view(s: ProbeState | None, now: float) -> dict[str, Any] | None:
    """The tracker's probes of one node, for the JSON (None: not probed yet)."""
    if s is None:
        return None
    return {"endpoint": s.endpoint, "failures": s.failures, "error": s.error,
            "last_ok_seconds_ago": None if s.last_ok is None else round(max(0.0, now - s.last_ok), 1),
            "rtt_ms": round(s.rtt * 1e3, 2), "ok_total": s.ok_total, "failed_total": s.failed_total}


def slim_view(e: Entry, now: float, ttl: float, probe: ProbeState | None = None,
              fail_limit: int = FAIL_LIMIT, mark: Mark | None = None) -> dict[str, Any]:
    """What ``status``, ``lookup`` and ``rank`` read of a node, cheaply: the part of ``node_view`` a node
    left out of an answer still counts with (its range in the coverage, its sessions, its rank)."""
    cap = e.advert.capability
    reached = probe is not None and probe.last_ok is not None
    return {"node_id": e.node_id, "model": cap.model_fingerprint, "model_name": cap.model_name,
            "model_file": cap.model_file, "n_layer": cap.n_layer, "range": [cap.range.start, cap.range.end],
            "alive": alive(probe, e.last_seen, now, ttl, fail_limit),
            "live_sessions": freshest(e.advert.health, e.last_seen, probe).health.live_sessions,
            "probe": {"last_ok_seconds_ago": 0.0} if reached else None, "misbehaving": mark is not None}


def current(registry: Registry, now: float, query: str | None = None, full: int | None = None) -> list[dict[str, Any]]:
    """The view of every registered node (of the model ``query`` names, if given), judged with what the
    probes found. ``full``: only the first ``full`` by ``rank`` get the whole ``node_view``, the rest a
    ``slim_view`` (an answer shows a bounded number of nodes: the rest need not be rendered)."""
    def of_query(e: Entry) -> bool:
        cap = e.advert.capability
        return query is not None and model_matches(cap.model_fingerprint, cap.model_name, query, cap.model_file)

    ttl, limit = registry.ttl, registry.probes.fail_limit
    judged = []
    for e in registry.live(now, None if query is None else of_query):
        probe = registry.probes.get(e.node_id, e.endpoint)
        mark = registry.marks.get(e.node_id)
        # rank's key, without building a view
        key = rank_key(alive(probe, e.last_seen, now, ttl, limit), probe is not None and probe.last_ok is not None,
                       e.node_id, mark is not None)
        judged.append((key, e, probe, mark))
    judged.sort(key=lambda j: j[0])
    return [node_view(e, now, ttl, probe, limit, mark) if full is None or i < full
            else slim_view(e, now, ttl, probe, limit, mark) for i, (_, e, probe, mark) in enumerate(judged)]


def mean_batch(steps: int, batches: int) -> float:
    """Sessions' steps per llama_decode call (1.0 = no cross-session batching; 0 before any step)."""
    return round(steps / batches, 2) if batches else 0.0


def matches(view: dict[str, Any], query: str) -> bool:
    return model_matches(str(view["model"]), str(view["model_name"]), query, str(view.get("model_file", "")))


def rank_key(live: bool, reached: bool, node_id: str, misbehaving: bool = False) -> tuple[bool, bool, bool, str]:
    """Nodes caught lying last of all; live nodes first, those the tracker's probes reached before those only
    heard from; then by id. A flood of fresh keys registers nodes nobody can reach: they are listed after every
    node that answers."""
    return (misbehaving, not live, not reached, node_id)


def rank(v: dict[str, Any]) -> tuple[bool, bool, bool, str]:
    """``rank_key`` of a view."""
    probe = v.get("probe")
    return rank_key(v["alive"], probe is not None and probe["last_ok_seconds_ago"] is not None, v["node_id"],
                    bool(v.get("misbehaving")))


def lookup(views: list[dict[str, Any]], query: str) -> dict[str, Any]:
    """The answer to /api/lookup: the *live* nodes of one model (nodes build routes from it), reached ones first,
    misbehaving ones (flagged ``misbehaving``) last, at most MAX_LOOKUP."""
    found = sorted((v for v in views if v["alive"] and matches(v, query)), key=rank)
    return {"model": query, "nodes": found[:MAX_LOOKUP], "omitted": max(0, len(found) - MAX_LOOKUP)}


def coverage(nodes: list[dict[str, Any]], n_layer: int) -> list[list[str]]:
    """For each layer, the node ids serving it."""
    return layer_coverage([(n["node_id"], n["range"][0], n["range"][1]) for n in nodes], n_layer)


def gaps(cov: list[list[str]]) -> list[list[int]]:
    """The runs of layers nobody serves, as [start, end) pairs."""
    out: list[list[int]] = []
    for i, layer in enumerate(cov):
        if layer:
            continue
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def route_sessions(nodes: list[dict[str, Any]], n_layer: int) -> int:
    """Route sessions running through a model: every one runs each layer on exactly one hop, so each
    layer's nodes hold them all (a two-hop session is one session, not two); the smallest such sum
    over the layers, which a layer nobody serves makes 0."""
    per_layer = [0] * n_layer
    for n in nodes:
        for i in range(max(0, n["range"][0]), min(n_layer, n["range"][1])):
            per_layer[i] += n["live_sessions"]
    return min(per_layer, default=0)


def status(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model: which live node serves each layer; dead and misbehaving nodes are listed but cover nothing.
    Live nodes
    first (``rank``); at most MAX_NODES_SHOWN nodes and MAX_MODELS_SHOWN models, the rest counted."""
    views = sorted(views, key=rank)
    models: dict[str, dict[str, Any]] = {}
    alive: dict[str, list[dict[str, Any]]] = {}
    first: dict[str, tuple[bool, bool, bool, str]] = {}
    for v in views:
        m = models.setdefault(v["model"], {"fingerprint": v["model"], "name": v["model_name"],
                                           "n_layer": min(v["n_layer"], MAX_LAYERS), "nodes": [], "dead": [],
                                           "misbehaving": []})
        first.setdefault(v["model"], rank(v))
        m["nodes"].append(v["node_id"])
        if v.get("misbehaving"):  # caught lying: serves nothing anyone should route through
            m["misbehaving"].append(v["node_id"])
        elif v["alive"]:
            alive.setdefault(v["model"], []).append(v)
        if not v["alive"]:
            m["dead"].append(v["node_id"])
    shown = sorted(models.values(), key=lambda m: (first[m["fingerprint"]][:3], m["name"]))[:MAX_MODELS_SHOWN]
    for m in shown:
        m["node_count"], m["dead_count"] = len(m["nodes"]), len(m["dead"])
        m["misbehaving_count"] = len(m["misbehaving"])
        m["nodes"] = m["nodes"][:MAX_MODEL_ROWS]
        rows = set(m["nodes"])
        m["dead"] = [nid for nid in m["dead"] if nid in rows]
        m["misbehaving"] = [nid for nid in m["misbehaving"] if nid in rows]
        mine = alive.get(m["fingerprint"], [])
        cov = coverage(mine, m["n_layer"])
        m["replicas"] = [len(layer) for layer in cov]  # live nodes serving each layer
        m["coverage"] = [layer[:MAX_MODEL_ROWS] for layer in cov]  # which ones (the first of them)
        m["gaps"] = gaps(cov)
        m["covered"] = not m["gaps"]
        m["active_sessions"] = route_sessions(mine, m["n_layer"])
    return {"models": sorted(shown, key=lambda m: m["name"]), "nodes": views[:MAX_NODES_SHOWN],
            "omitted": {"nodes": max(0, len(views) - MAX_NODES_SHOWN),
                        "models": max(0, len(models) - MAX_MODELS_SHOWN)}}


def known_nodes(registry: Registry, now: float) -> dict[str, Known]:
    """Every registered node's model and range: what a reported route is checked against."""
    return {e.node_id: Known(e.advert.capability.model_fingerprint, e.advert.capability.range.start,
                             e.advert.capability.range.end) for e in registry.live(now)}


def routes_in_use(registry: Registry, now: float) -> list[dict[str, Any]]:
    """The routes in use (meshnode/web/mapdoc.py): what the live heads reported in their freshest counters
    (the last probe's or heartbeat's), checked against the registered nodes; a dead or misbehaving
    reporter's are left out."""
    ttl, limit = registry.ttl, registry.probes.fail_limit
    reports = []
    for e in registry.live(now):
        probe = registry.probes.get(e.node_id, e.endpoint)
        if e.node_id in registry.marks or not alive(probe, e.last_seen, now, ttl, limit):
            continue
        health = freshest(e.advert.health, e.last_seen, probe).health
        if health.routes:
            reports.append((e.node_id, health.routes))
    return mapdoc.routes(reports, known_nodes(registry, now))


def charted(registry: Registry, now: float) -> list[Charted]:
    """The nodes with a line in the charts: every registered one with samples (its model, whether it
    serves the model's last layer)."""
    out = []
    for e in registry.live(now):
        cap = e.advert.capability
        if e.node_id in registry.series.tracks:
            out.append(Charted(e.node_id, cap.model_fingerprint, cap.model_name, cap.range.end == cap.n_layer))
    return out
