"""Riding out a failing dependency: backoff delays and an outage clock with a budget.

The worker retries the source, the sink and the dead-letter target the same way
(docs/operations.md): after each failure it waits a jittered, doubling delay; an
``Outage`` remembers since when the dependency has been failing, reports it as a
health problem while it lasts, and says when its budget
(``QWORKER_SOURCE_OUTAGE_SECONDS`` / ``QWORKER_SINK_OUTAGE_SECONDS``) is spent: the
worker then stops with exit 69.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: A dependency counts as down (receiving pauses, health fails) after failing this long:
#: a single throttled request is a blip, not an outage.
DOWN_AFTER_S = 1.0


class Backoff:
    """Full-jitter exponential backoff: attempt k waits ``uniform(0, min(cap, first*2**(k-1)))``."""

    def __init__(self, first: float = 0.05, cap: float = 15.0,
                 rng: random.Random | None = None) -> None:
        self.first = first
        self.cap = cap
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        ceiling = min(self.cap, self.first * 2 ** min(max(attempt, 1) - 1, 30))
        return self._rng.uniform(ceiling / 4, ceiling)


class Outage:
    """Since when one dependency keeps failing; ``on_change(name, down)`` tracks health.

    Not thread-safe: used from the worker's event loop.
    """

    def __init__(self, name: str, budget_s: float,
                 on_change: Callable[[str, bool], None] | None = None) -> None:
        self.name = name
        self.budget_s = budget_s
        self._on_change = on_change
        self.since: float | None = None
        self.failures = 0
        self._reported = False
        self.last_error: BaseException | None = None

    def failed(self, exc: BaseException, now: float | None = None) -> float:
        """Record a failure; return for how long the dependency has been failing."""
        now = time.monotonic() if now is None else now
        self.failures += 1
        self.last_error = exc
        if self.since is None:
            self.since = now
            log.warning("%s failing, retried for up to %.0fs: %s", self.name, self.budget_s, exc)
        down_for = now - self.since
        if not self._reported and down_for >= DOWN_AFTER_S:
            self._reported = True
            log.error("%s down for %.1fs: %s", self.name, down_for, exc)
            if self._on_change is not None:
                self._on_change(self.name, True)
        return down_for

    def recovered(self) -> None:
        """Record a success: the outage (if any) is over."""
        if self.since is None:
            return
        if self._reported:
            log.warning("%s works again after %.1fs", self.name, time.monotonic() - self.since)
            if self._on_change is not None:
                self._on_change(self.name, False)
        self.since = None
        self.failures = 0
        self._reported = False
        self.last_error = None

    def down_for(self, now: float | None = None) -> float:
        """Seconds since the first failure of the current outage (0.0 when up)."""
        if self.since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.since

    @property
    def down(self) -> bool:
        """True once the dependency has been failing for ``DOWN_AFTER_S``."""
        return self.since is not None and self.down_for() >= DOWN_AFTER_S

    def exhausted(self, now: float | None = None) -> bool:
        """True once the outage has lasted the whole budget."""
        return self.since is not None and self.down_for(now) >= self.budget_s
