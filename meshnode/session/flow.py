"""Flow-control credits of one session stream, as negotiated at open (the strictest side wins).

Two windows, both ``credits`` wide (0 = no limit):

* **steps in**: the sender may have at most ``credits`` steps unanswered on the
  stream; one more is refused with FLOW_CONTROL_VIOLATION (not executed) and
  may be sent again once a result has come back — each result returns its credit.
* **results out** (a Generate): the head streams at most ``credits`` results
  the initiator has not acknowledged, then pauses before the next step; a
  ``CreditGrant`` from the initiator tops the window up and the decode resumes.
  A slow reader thus holds the head back instead of piling results up in memory.
"""

from __future__ import annotations

import asyncio

from meshnode import errors

#: the most a window may be topped up to (a grant beyond is a violation)
MAX_WINDOW = 1 << 16


class Flow:
    def __init__(self, credits: int) -> None:
        self.credits = credits
        #: steps received and not yet answered
        self.inflight = 0
        #: results the head may still stream in a Generate
        self.window = credits
        self._changed = asyncio.Event()

    def admit(self) -> None:
        """A step arrived: count it, or refuse it if the sender is out of credits."""
        if self.credits and self.inflight >= self.credits:
            raise errors.FlowControlError(
                f"{self.inflight} steps are unanswered and the negotiated credits are {self.credits}; "
                "wait for a result before sending more")
        self.inflight += 1

    def answered(self) -> None:
        self.inflight = max(self.inflight - 1, 0)

    def grant(self, n: int) -> None:
        """The initiator acknowledged ``n`` results: the Generate may stream ``n`` more."""
        if n < 1 or self.window + n > MAX_WINDOW:
            raise errors.FlowControlError(f"a grant of {n} credits (window {self.window}) is out of bounds")
        self.window += n
        self._changed.set()

    def would_wait(self) -> bool:
        """True if ``take`` would pause now (the initiator has acknowledged too few results)."""
        return bool(self.credits) and self.window <= 0

    async def take(self, stop: asyncio.Event) -> bool:
        """Before streaming a result: wait for a credit. False if ``stop`` was set meanwhile."""
        while self.credits and self.window <= 0 and not stop.is_set():
            self._changed.clear()
            waiters = [asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        if stop.is_set():
            return False
        if self.credits:
            self.window -= 1
        return True

    def refund(self) -> None:
        """The step a credit was taken for failed: no result went out, the credit comes back."""
        if self.credits:
            self.window += 1
