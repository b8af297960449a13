"""Tiny random-weight GGUFs of every architecture meshnode cuts, one module per family.

``core.Tiny`` writes the keys every llama.cpp loader reads and offers the
tensor helpers; each family module has one ``build_<arch>(t)`` per
architecture that adds its own keys and tensors, following the loader of
that architecture at the pinned build (``src/models/<file>.cpp``,
``load_arch_hparams`` / ``load_arch_tensors``). ``make(path, name, ...)``
builds one by its registered name (``BUILDERS``).
"""

from tests.tiny.core import BUILDERS, Spec, Tiny, make

__all__ = ["BUILDERS", "Spec", "Tiny", "make"]
