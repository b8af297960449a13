"""The range executor over llama.cpp: bindings -> owning wrapper -> executor API."""

from meshnode.executor.api import RangeExecutor, Timed
from meshnode.executor.config import ExecConfig

__all__ = ["ExecConfig", "RangeExecutor", "Timed"]
