"""How many tokens to draft: grow while drafts are accepted whole, shrink while they fail."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    """The next draft's length, between ``least`` and ``most`` (``--draft-max``).

    A draft accepted whole doubles it (up to ``most``); one accepted in part sets it to one more
    than what was accepted; after ``patience`` drafts in a row with nothing accepted (or nothing to
    draft) it drops to 0 and a draft of ``least`` is tried again only every ``patience`` steps, or
    at once after ``wake`` (the caller decoded a stretch without drafting), so free text that drafts
    never predict costs almost nothing.
    """

    most: int = 8
    least: int = 1
    patience: int = 4
    k: int = 0
    misses: int = 0
    idle: int = 0

    def __post_init__(self) -> None:
        if self.most < self.least or self.least < 1:
            raise ValueError(f"draft lengths must satisfy 1 <= least <= most, not {self.least}..{self.most}")
        self.k = self.k or self.most

    def next(self) -> int:
        """The length to draft now (0: decode this step without a draft)."""
        if self.misses >= self.patience:
            self.idle += 1
            if self.idle < self.patience:
                return 0
            self.idle = 0
            return self.least
        return self.k

    def wake(self) -> None:
        """The caller decoded a stretch without drafts: the next call tries one again."""
        if self.misses >= self.patience:
            self.idle = self.patience - 1

    def update(self, drafted: int, accepted: int) -> None:
        """Record a verified draft of ``drafted`` tokens of which ``accepted`` stood (0 drafted: there was
        nothing to draft, a miss too)."""
        if drafted <= 0:
            self.misses += 1
            return
        if accepted > 0:
            self.idle = 0
        if accepted >= drafted:
            self.k, self.misses = min(self.most, max(self.k, drafted) * 2), 0
        elif accepted == 0:
            self.misses += 1
            self.k = max(self.least, self.k // 2)
        else:
            self.k, self.misses = max(self.least, min(self.most, accepted + 1)), 0
