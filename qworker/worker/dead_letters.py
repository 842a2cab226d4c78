"""Dead-lettering a message, retried through a failing dead-letter target, never dropped.

A dead letter that cannot be sent is retried with backoff; the message stays unacked
meanwhile (the Kafka watermark waits for it, the SQS message stays held). It is handed
back (redelivered later) only when the drain runs out or the target has failed for the
outage budget, and then the worker stops with exit 69 (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from qworker.worker.drain import DrainControl
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.sources.base import Message, Source
from qworker.worker.summary import RunSummary

log = logging.getLogger(__name__)


class DeadLetters:
    """Sends dead letters through ``source``; ``deadline()`` is the drain's end, if any."""

    def __init__(self, source: Source, outage_seconds: float, drain: DrainControl,
                 metrics: WorkerMetrics, summary: RunSummary,
                 deadline: Callable[[], float | None], on_exhausted: Callable[[str], None],
                 backoff: Backoff | None = None) -> None:
        self.source = source
        self.outage = Outage("dead_letter", outage_seconds, metrics.set_problem)
        self.drain = drain
        self.metrics = metrics
        self.summary = summary
        self._deadline = deadline
        self._on_exhausted = on_exhausted
        self._backoff = backoff or Backoff(first=0.2, cap=5.0)

    async def send(self, msg: Message, reason: str) -> None:
        """Dead-letter ``msg`` with ``reason``; see the module docstring."""
        attempt = 0
        while True:
            try:
                await self.source.dead_letter(msg, reason)
                break
            except Exception as exc:
                attempt += 1
                now = time.monotonic()
                self.outage.failed(exc, now)
                deadline = self._deadline()
                exhausted = self.outage.exhausted(now)
                if exhausted or self.drain.immediate.is_set() or (
                        deadline is not None and now >= deadline):
                    log.error("dead letter not sent, message left unacked: %s", exc,
                              extra={"message_id": msg.message_id})
                    self.summary.abandoned += 1
                    await self.source.abandon(msg)
                    if exhausted:
                        self._on_exhausted(f"dead-letter target failing for "
                                           f"{self.outage.down_for(now):.0f}s: {exc}")
                    return
                delay = self._backoff.delay(attempt)
                if deadline is not None:
                    delay = max(0.0, min(delay, deadline - now))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.drain.immediate.wait(), delay)
        self.outage.recovered()
        self.summary.dead_lettered += 1
        self.metrics.jobs_dead_lettered.inc()
