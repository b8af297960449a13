"""The architectures meshnode cuts, each decision read in llama.cpp at the pinned build.

Paths are under llama.cpp's ``src/`` as vendored by llama-cpp-python 0.3.36
(``vendor/llama.cpp/src``). Generic facts every entry relies on:

* ``llama-graph.cpp`` ``build_inp_embd``: a batch of embeddings (``ubatch.embd``)
  enters through the same selection as token rows; the only scaling there is
  ``f_embedding_scale`` (granite family). What a graph does after it is in
  its own file.
* ``llama-model.cpp`` ``load_swa_pattern``: an explicit per-layer array under
  ``{arch}.attention.sliding_window_pattern`` wins over any default period.
* ``llama-model.cpp`` ``load_hparams``: per-layer values (``head_count``,
  ``head_count_kv``, ``feed_forward_length``, ``expert_feed_forward_length``,
  ``expert_used_count``) are read with ``get_key_or_arr`` over
  ``n_layer_all``, so a slice carries its layers' entries (slicer.py).
  ``n_layer() = n_layer_all - n_layer_nextn`` (llama-hparams.cpp): the
  next-token-prediction blocks at the end are not part of the trunk.
* Every graph here names the residual after layer ``il`` ``l_out-{il}``
  (``cb(cur, "l_out", il)``), where a non-tail range stops (native/capture.c).
"""

from __future__ import annotations

from meshnode.gguf.arch import ArchPolicy, Refused
from meshnode.gguf.archtable import deepseek, dense, moe, newer, scaled, windowed

#: one module per family; each lists ENTRIES (cut exactly) and REFUSED (with the reason)
_FAMILIES = (dense, moe, scaled, windowed, deepseek, newer)

POLICIES: dict[str, ArchPolicy] = {p.arch: p for fam in _FAMILIES for p in fam.ENTRIES}

#: architectures the pinned build loads that are refused for partial cuts, with the reason
REFUSED: dict[str, Refused] = {r.arch: r for fam in _FAMILIES for r in fam.REFUSED}
