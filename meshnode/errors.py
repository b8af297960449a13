"""The typed errors of meshnode.

Each error says *who* failed: the caller's input (``InputError``), a model or
range artifact (``ModelError``), a peer or the route (``PeerError``,
``RouteError``), the wire (``WireError``), or this node itself
(``ExecutorError``). Every error carries a stable ``code`` that is also its
value on the wire (``ErrorCode`` in ``proto/meshnode/proto/node.proto``), so
an error raised on one hop is re-raised as the same type on the initiator.

Foreign errors (grpc status codes, llama.cpp return codes, OSError) are
translated into these at the boundary that meets them, with ``raise ... from``.
"""

from __future__ import annotations

from typing import ClassVar


class MeshnodeError(Exception):
    """Base of every meshnode error. ``code`` is the wire ErrorCode name."""

    code: ClassVar[str] = "INTERNAL"
    #: which party is at fault, for messages and exit codes
    party: ClassVar[str] = "meshnode"

    def __init__(self, message: str, *, hop: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: the endpoint of the hop that reported the error, if it came off the wire
        self.hop = hop

    def __str__(self) -> str:
        where = f" [hop {self.hop}]" if self.hop else ""
        return f"{self.code}: {self.message}{where}"


# --- the caller's input -----------------------------------------------------


class InputError(MeshnodeError):
    """The caller asked for something invalid (a bad flag, range, prompt)."""

    code = "INVALID_ARGUMENT"
    party = "input"


class LayerRangeError(InputError):
    """A layer range is empty, reversed, or outside [0, n_layer)."""

    code = "LAYER_RANGE_INVALID"


# --- models and range artifacts --------------------------------------------


class ModelError(MeshnodeError):
    """A model file or range artifact is unusable."""

    code = "MODEL_INVALID"
    party = "model"


class ModelNotFoundError(ModelError):
    code = "MODEL_NOT_FOUND"


class ModelFormatError(ModelError):
    """The file is not a GGUF, is truncated, or its metadata is inconsistent."""

    code = "MODEL_FORMAT"


class CutRefusedError(ModelError):
    """A range cannot be executed exactly for this architecture / cut point."""

    code = "CUT_REFUSED"


class ModelDownloadError(ModelError):
    code = "MODEL_DOWNLOAD"


class ManifestError(ModelFormatError):
    """A model manifest that is malformed, inconsistent, or not the one its model id names."""

    code = "MANIFEST_INVALID"


class FetchBusyError(MeshnodeError):
    """A node serves as many fetches of model bytes as it allows (for this requester, or in all)."""

    code = "FETCH_BUSY"
    party = "peer"


class IntegrityError(ModelError):
    """The bytes loaded do not match the range's manifest: never served."""

    code = "INTEGRITY_FAILED"


# --- signatures and attestations ------------------------------------------


class AttestationError(MeshnodeError):
    """A signed statement does not hold."""

    code = "SIGNATURE_INVALID"
    party = "peer"


class SignatureError(AttestationError):
    """Forged or tampered: the signature does not verify, or the id is not the key's."""

    code = "SIGNATURE_INVALID"


class AttestationExpiredError(AttestationError):
    code = "ATTESTATION_EXPIRED"


class OpenForgedError(AttestationError):
    """A route open whose signature does not verify."""

    code = "OPEN_FORGED"


class OpenExpiredError(AttestationError):
    code = "OPEN_EXPIRED"


class OpenReplayedError(AttestationError):
    """A route open whose nonce this hop has already accepted."""

    code = "OPEN_REPLAYED"


class OpenMismatchError(AttestationError):
    """A genuine open for another hop, range, model or session."""

    code = "OPEN_MISMATCH"


class OpenUnauthenticatedError(AttestationError):
    """The stream does not come from the previous hop the open names."""

    code = "OPEN_UNAUTHENTICATED"


class AdvertReplayedError(AttestationError):
    """A tracker registration that is not newer than one already accepted."""

    code = "ADVERT_REPLAYED"


class AttestationMismatchError(AttestationError):
    """Valid signature, but it attests to something other than what is served."""

    code = "ATTESTATION_MISMATCH"


# --- the wire ---------------------------------------------------------------


class WireError(MeshnodeError):
    """A message or tensor bundle is malformed."""

    code = "PAYLOAD_CORRUPT"
    party = "peer"


class ChecksumError(WireError):
    code = "CHECKSUM_MISMATCH"


class TilingError(WireError):
    """Fragments do not tile the bundle exactly (gap, overlap, overrun)."""

    code = "FRAGMENT_TILING"


class ShapeError(WireError):
    """A tensor's dtype, shape or values do not fit the step it came with."""

    code = "TENSOR_SHAPE"


class SchemaError(WireError):
    code = "SCHEMA_UNSUPPORTED"


# --- peers and routes ---------------------------------------------------------


class PeerError(MeshnodeError):
    """A peer failed, is unreachable, or is not what it claims."""

    code = "PEER_UNAVAILABLE"
    party = "peer"


class NotAMeshnodeError(PeerError):
    code = "NOT_A_MESHNODE"


class ImpostorError(PeerError):
    """The endpoint answered with another node's identity than the one the caller meant to reach."""

    code = "PEER_IMPOSTOR"


class TransportSecurityError(PeerError):
    """No TLS the caller can trust: the peer speaks none, or its certificate is bound to no identity."""

    code = "TRANSPORT_INSECURE"


class MisbehavedError(PeerError):
    """A hop's sealed output differs from a replica's recomputation of the same inputs (an audit),
    or its seals contradict each other: it computed wrong, whatever it meant."""

    code = "HOP_MISBEHAVED"

    def __init__(self, message: str, *, hop: str | None = None, pos: int = 0) -> None:
        super().__init__(message, hop=hop)
        #: the first position whose result is not to be trusted (a failover rolls back to it)
        self.pos = pos


class FingerprintMismatchError(PeerError):
    code = "FINGERPRINT_MISMATCH"


class RangeMismatchError(PeerError):
    """A hop was asked for a range it does not serve."""

    code = "RANGE_MISMATCH"


class RouteError(InputError):
    """The peers given do not form a route: a gap, an overlap, mixed models."""

    code = "ROUTE_INVALID"


class DeadlineError(PeerError):
    code = "DEADLINE_EXCEEDED"


# --- session state ----------------------------------------------------------


class SessionError(MeshnodeError):
    """A step does not fit the session it names."""

    code = "SESSION_INVALID"
    party = "peer"


class UnknownSessionError(SessionError):
    code = "UNKNOWN_SESSION"


class CacheMissError(SessionError):
    """A hop lacks the KV state a step expects (positions do not follow)."""

    code = "CACHE_MISS"


class CapacityError(SessionError):
    """No free session slot / KV capacity: refused, never an out-of-memory."""

    code = "RESOURCE_EXHAUSTED"


class EpochStaleError(SessionError):
    """A frame carries another route epoch than the session's."""

    code = "EPOCH_STALE"


class FlowControlError(SessionError):
    """More unanswered steps than the negotiated credits."""

    code = "FLOW_CONTROL_VIOLATION"


class CancelledError(SessionError):
    code = "CANCELLED"


# --- this node ---------------------------------------------------------------


class ExecutorError(MeshnodeError):
    """llama.cpp failed inside this node."""

    code = "EXECUTOR_FAILED"
    party = "meshnode"


def _all_subclasses(cls: type[MeshnodeError]) -> list[type[MeshnodeError]]:
    out: list[type[MeshnodeError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


#: wire code -> error class, for re-raising a peer's error on this side
BY_CODE: dict[str, type[MeshnodeError]] = {c.code: c for c in _all_subclasses(MeshnodeError)}


def from_code(code: str, message: str, *, hop: str | None = None) -> MeshnodeError:
    """Rebuild the typed error a peer reported (unknown codes become PeerError)."""
    cls = BY_CODE.get(code, PeerError)
    return cls(message, hop=hop)


def typed_leaf(group: BaseExceptionGroup[BaseException]) -> MeshnodeError | None:
    """The first MeshnodeError inside a (nested) exception group, if any.

    trio nurseries (and trio-asyncio's loop) wrap errors in groups; the edges
    (CLI, tests) report the typed error such a group carries.
    """
    for exc in group.exceptions:
        if isinstance(exc, MeshnodeError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = typed_leaf(exc)
            if found is not None:
                return found
    return None
