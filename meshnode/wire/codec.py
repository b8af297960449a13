"""Domain <-> protobuf: errors, capabilities, numerics."""

from __future__ import annotations

import time

from meshnode import errors
from meshnode.executor.config import ExecConfig
from meshnode.proto import node_pb2 as pb

#: codes after which the session cannot continue
TERMINAL = frozenset({
    "SCHEMA_UNSUPPORTED", "FINGERPRINT_MISMATCH", "RANGE_MISMATCH", "RESOURCE_EXHAUSTED",
    "UNKNOWN_SESSION", "EXECUTOR_FAILED", "PEER_UNAVAILABLE", "SESSION_INVALID", "INTERNAL",
    "NOT_A_MESHNODE", "ROUTE_INVALID",
})


def error_to_pb(e: errors.MeshnodeError, *, hop: str, step_id: int = 0, terminal: bool | None = None) -> pb.Error:
    code = e.code if e.code in pb.ErrorCode.keys() else "INTERNAL"
    return pb.Error(
        code=pb.ErrorCode.Value(code),
        message=e.message,
        hop=e.hop or hop,
        terminal=(code in TERMINAL) if terminal is None else terminal,
        retryable=code in ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CACHE_MISS", "PEER_UNAVAILABLE"),
        step_id=step_id,
    )


def error_from_pb(err: pb.Error) -> errors.MeshnodeError:
    return errors.from_code(pb.ErrorCode.Name(err.code), err.message, hop=err.hop or None)


def numerics_to_pb(c: ExecConfig) -> pb.Numerics:
    return pb.Numerics(
        n_ctx_per_session=c.n_ctx_per_session, n_batch=c.n_batch, n_ubatch=c.n_ubatch, flash_attn=c.flash_attn,
        rope_ctx_orig=c.rope_ctx_orig,
    )


def numerics_key(n: pb.Numerics) -> tuple[tuple[str, int | bool], ...]:
    """The settings that change numerics: a route's hops must agree on them.

    ``n_ctx_per_session`` is not one of them (it bounds a session's length,
    executor/context.py): hops may differ; a route's context is its smallest.
    Except for which side of a LongRoPE model's original context it lies on
    (``rope_ctx_orig``): that picks the rope factors.
    """
    return (
        ("n_batch", n.n_batch),
        ("n_ubatch", n.n_ubatch),
        ("flash_attn", n.flash_attn),
        ("long_rope", bool(n.rope_ctx_orig) and n.n_ctx_per_session > n.rope_ctx_orig),
    )


def now_ns() -> int:
    return time.time_ns()


def deadline_in(seconds: float) -> int:
    return time.time_ns() + int(seconds * 1e9)


#: the most a hop takes off the deadline it passes on (see ``sooner``)
MAX_HOP_MARGIN_NS = 10**9


def sooner(deadline_ns: int, now_ns: int | None = None) -> int:
    """The deadline a hop gives the next hop: an eighth of what is left sooner (at most 1 s), so that a
    silent hop is given up on first by the hop right before it, whose error then names it, not by a hop
    further up, which would blame its own next hop (a live one). None (0) stays none. Pure with ``now_ns``."""
    if not deadline_ns:
        return 0
    left = deadline_ns - (time.time_ns() if now_ns is None else now_ns)
    return deadline_ns - min(MAX_HOP_MARGIN_NS, max(0, left) // 8)


def seconds_left(deadline_ns: int) -> float | None:
    """Seconds until ``deadline_ns`` (None if there is none); negative once past."""
    if not deadline_ns:
        return None
    return (deadline_ns - time.time_ns()) / 1e9
