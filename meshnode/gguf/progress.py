"""Progress of a long cut as a few plain lines on stderr (a pipe or a journal, not only a terminal).

A line whenever the phase changes and at every quarter of a phase's steps:
``meshnode: cutting layers 0:15 of M.gguf: writing layers 0:15 50% (68/136 tensors)``.
``meshnode serve`` streams these lines from its ``model slice`` child.
"""

from __future__ import annotations

import sys
from typing import TextIO

#: report at every this fraction of a phase
STEP = 0.25
#: lines a node streams from its cutting child start with this
PREFIX = "meshnode: "


class LineProgress:
    """A ``slicer.Progress`` that prints throttled lines."""

    def __init__(self, title: str, out: TextIO | None = None) -> None:
        self.title, self.out = title, out
        self._phase = ""
        self._next = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        frac = done / total if total else 1.0
        if what != self._phase:
            self._phase, self._next = what, STEP
            if done < total:
                self._line(what)
                return
        if frac + 1e-9 >= self._next and total > 1:
            self._line(f"{what} {frac:.0%} ({done}/{total} tensors)")
            while self._next <= frac + 1e-9:
                self._next += STEP

    def _line(self, text: str) -> None:
        print(f"{PREFIX}{self.title}: {text}", file=self.out or sys.stderr, flush=True)
