"""Storing result records: the worker's one retry loop around the sink, and its outage state.

``ResultWriter.store`` writes one record and reports what happened; the worker acks
the message only for ``WRITTEN``, ``DUPLICATE`` or ``CONFLICT`` (a record is stored for
the job either way) and abandons it for ``UNSTORED``. A failing write is retried with
jittered, doubling delays (50 ms up to 15 s) for as long as the sink has been failing
less than ``sink_outage_seconds``; meanwhile ``sink_down`` pauses receiving and the
health endpoints fail. Once the budget is spent ``on_exhausted`` is called (the worker
stops with exit 69) and every write still waiting gives up.

On "already stored" the fingerprints decide (docs/formats.md, fingerprints and
conflicts): the same request is a redelivery (``DUPLICATE``); a different request
under the same custom_id gets a ``duplicate_custom_id`` record of its own under
``_conflicts/``, written once, and the stored answer is kept (``CONFLICT``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from qworker.schema import conflict_key, conflict_record, dumps, result_key
from qworker.worker.drain import DrainControl
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.sinks.base import PutResult, Sink

log = logging.getLogger(__name__)


class Stored(Enum):
    """The outcome of one ``ResultWriter.store``."""

    WRITTEN = "written"
    DUPLICATE = "duplicate"  # the same request's result was already there
    CONFLICT = "conflict"  # another request's result is there; a conflict record was written
    UNSTORED = "unstored"  # gave up (outage budget spent, or the drain ran out)


@dataclass(slots=True)
class Conflict:
    """How to record a conflict: its key and record, built by the caller from the fingerprints."""

    key: str
    record: dict[str, Any]


class ResultWriter:
    """Writes result records to ``sink``; see the module docstring.

    ``conflict_for(stored_fingerprint)`` builds the conflict record of a job whose key
    holds another request's result. ``drain_deadline`` (monotonic), once set, bounds
    the retries of a draining worker. Used from the worker's event loop only.
    """

    def __init__(
        self,
        sink: Sink,
        outage_seconds: float,
        drain: DrainControl,
        metrics: WorkerMetrics,
        on_exhausted: Callable[[str], None],
        backoff: Backoff | None = None,
        prefix: str = "",
    ) -> None:
        self.sink = sink
        self.prefix = prefix
        self.drain = drain
        self.metrics = metrics
        self.outage = Outage("sink", outage_seconds, metrics.set_problem)
        self._on_exhausted = on_exhausted
        self._backoff = backoff or Backoff()
        self.drain_deadline: float | None = None
        self.failures = 0

    @property
    def sink_down(self) -> bool:
        """True while the sink keeps failing: finished results wait, so take no new work."""
        return self.outage.down

    async def store_result(
        self,
        custom_id: str,
        batch_id: str | None,
        record: dict[str, Any],
        fingerprint: str | None,
        log_extra: dict[str, Any] | None = None,
    ) -> tuple[Stored, str]:
        """Store one job's result line at its key (docs/formats.md, "Object keys").

        Returns the outcome and the key. A key holding another request's answer gets
        this job's ``duplicate_custom_id`` line under ``_conflicts/`` instead.
        """
        key = result_key(self.prefix, batch_id, custom_id)

        def conflict_for(stored_fingerprint: str | None) -> Conflict:
            assert fingerprint is not None
            return Conflict(
                conflict_key(self.prefix, batch_id, custom_id, fingerprint),
                conflict_record(custom_id, batch_id, fingerprint, stored_fingerprint,
                                record.get("metadata")),
            )

        return await self.store(key, record, fingerprint, conflict_for, log_extra), key

    async def store(
        self,
        key: str,
        record: dict[str, Any],
        fingerprint: str | None,
        conflict_for: Callable[[str | None], Conflict] | None = None,
        log_extra: dict[str, Any] | None = None,
    ) -> Stored:
        """Write ``record`` at ``key`` once; see ``Stored`` for the outcomes."""
        result = await self._put(key, dumps(record), fingerprint, log_extra)
        if result is None:
            return Stored.UNSTORED
        if result.written:
            return Stored.WRITTEN
        stored = result.stored_fingerprint
        if fingerprint is None or stored is None or stored == fingerprint or conflict_for is None:
            return Stored.DUPLICATE
        conflict = conflict_for(stored)
        written = await self._put(conflict.key, dumps(conflict.record), fingerprint, log_extra)
        if written is None:
            return Stored.UNSTORED
        if written.written:
            self.metrics.jobs_conflict.inc()
            log.error("duplicate_custom_id: %s holds another request's result (fingerprint %s, "
                      "this one %s); conflict recorded at %s", key, stored[:12],
                      fingerprint[:12], conflict.key, extra=log_extra)
        else:
            log.info("duplicate_custom_id conflict already recorded at %s", conflict.key,
                     extra=log_extra)
        return Stored.CONFLICT

    async def _put(self, key: str, body: bytes, fingerprint: str | None,
                   log_extra: dict[str, Any] | None) -> PutResult | None:
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                result = await self.sink.put(key, body, fingerprint)
            except Exception as exc:  # nothing stored for sure: keep the record, try again
                attempt += 1
                self.failures += 1
                self.metrics.sink_retries.inc()
                if not await self._wait_to_retry(exc, attempt, log_extra):
                    return None
                continue
            self.outage.recovered()
            self.metrics.sink_put_seconds.observe(time.monotonic() - started)
            return result

    async def _wait_to_retry(self, exc: Exception, attempt: int,
                             log_extra: dict[str, Any] | None) -> bool:
        """Back off after a failed write; False when the write is given up."""
        now = time.monotonic()
        self.outage.failed(exc, now)
        exhausted = self.outage.exhausted(now)
        deadline = self.drain_deadline
        if exhausted or self.drain.immediate.is_set() or (deadline is not None and now >= deadline):
            log.error("sink write given up, job left unacked: %s", exc, extra=log_extra)
            if exhausted:
                self._on_exhausted(f"sink failing for {self.outage.down_for(now):.0f}s")
            return False
        delay = self._backoff.delay(attempt)
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - now))
        log.debug("sink write failed (attempt %d), again in %.2fs: %s", attempt, delay, exc,
                  extra=log_extra)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain.immediate.wait(), delay)
        return True
