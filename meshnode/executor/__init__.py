"""The range executor over llama.cpp: bindings -> owning wrapper -> executor API.

``RangeExecutor`` and ``Timed`` load llama.cpp, so they are imported on first use: a process must be
able to import the config (``meshnode.executor.config``) and set libgomp's environment
(``meshnode.executor.openmp``) before llama.cpp is loaded.
"""

from typing import TYPE_CHECKING, Any

from meshnode.executor.config import ExecConfig

if TYPE_CHECKING:
    from meshnode.executor.api import RangeExecutor, Timed

__all__ = ["ExecConfig", "RangeExecutor", "Timed"]


def __getattr__(name: str) -> Any:
    if name in ("RangeExecutor", "Timed"):
        from meshnode.executor import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
