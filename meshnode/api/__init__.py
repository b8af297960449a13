"""The OpenAI-compatible HTTP API: ``meshnode api`` (a gateway) or ``serve --api`` (beside a node)."""

from meshnode.api.app import ApiConfig, Gateway
from meshnode.api.mesh import MeshSource, MeshView
from meshnode.api.run import run_api

__all__ = ["ApiConfig", "Gateway", "MeshSource", "MeshView", "run_api"]
