"""What the tracker shows: pure functions from registry entries to JSON-able data."""

from __future__ import annotations

import base64
from typing import Any

from meshnode.routing.assign import coverage as layer_coverage
from meshnode.routing.assign import model_matches
from tracker.registry import Entry


def node_view(e: Entry, now: float, ttl: float) -> dict[str, Any]:
    cap = e.advert.capability
    hw, tput, h = cap.hardware, cap.throughput, e.advert.health
    return {
        "node_id": e.node_id,
        "endpoints": list(cap.endpoints),
        "model": cap.model_fingerprint,
        "model_name": cap.model_name,
        "model_file": cap.model_file,
        "range": [cap.range.start, cap.range.end],
        "role": cap.role,
        "n_layer": cap.n_layer,
        "decode_tokens_per_second": round(tput.decode_tokens_per_second, 1),
        "prefill_tokens_per_second": round(tput.prefill_tokens_per_second, 1),
        "cpu": hw.cpu_model,
        "cores": hw.cores,
        "cpu_features": list(hw.cpu_features),
        "memory_total_bytes": hw.memory_total_bytes,
        "devices": [{"name": d.name, "type": d.type, "description": d.description} for d in hw.devices],
        # headline figures of the node's last heartbeat (its HealthReply)
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
        "max_sessions": cap.max_sessions,
        "last_seen_seconds_ago": round(max(0.0, now - e.last_seen), 1),
        "alive": now - e.last_seen <= ttl,
        "envelope": base64.b64encode(e.envelope.SerializeToString()).decode(),
    }


def mean_batch(steps: int, batches: int) -> float:
    """Sessions' steps per llama_decode call (1.0 = no cross-session batching; 0 before any step)."""
    return round(steps / batches, 2) if batches else 0.0


def matches(view: dict[str, Any], query: str) -> bool:
    return model_matches(str(view["model"]), str(view["model_name"]), query, str(view.get("model_file", "")))


def coverage(nodes: list[dict[str, Any]], n_layer: int) -> list[list[str]]:
    """For each layer, the node ids serving it."""
    return layer_coverage([(n["node_id"], n["range"][0], n["range"][1]) for n in nodes], n_layer)


def status(views: list[dict[str, Any]]) -> dict[str, Any]:
    models: dict[str, dict[str, Any]] = {}
    for v in views:
        m = models.setdefault(v["model"], {"fingerprint": v["model"], "name": v["model_name"],
                                           "n_layer": v["n_layer"], "nodes": []})
        m["nodes"].append(v["node_id"])
    for m in models.values():
        members = [v for v in views if v["model"] == m["fingerprint"]]
        m["coverage"] = coverage(members, m["n_layer"])
        m["covered"] = all(m["coverage"])
        m["active_sessions"] = sum(v["live_sessions"] for v in members)
    return {"models": sorted(models.values(), key=lambda m: m["name"]), "nodes": views}
