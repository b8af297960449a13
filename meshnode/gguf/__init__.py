"""GGUF handling: reading model metadata, cutting exact layer ranges, manifests."""

from meshnode.gguf.arch import ArchPolicy, check_cut, policy_for
from meshnode.gguf.model import ModelInfo, fingerprint, inspect_model
from meshnode.gguf.slicer import RangeArtifact, Role, ensure_range

__all__ = [
    "ArchPolicy",
    "ModelInfo",
    "RangeArtifact",
    "Role",
    "check_cut",
    "ensure_range",
    "fingerprint",
    "inspect_model",
    "policy_for",
]
