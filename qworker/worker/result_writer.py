"""Storing records in the sink, through the sink's ``Retrier`` (qworker/worker/retry.py).

``ResultWriter.store`` writes one record once and reports what happened (``Stored``):
the job's message is acknowledged for ``WRITTEN``, ``DUPLICATE`` or ``CONFLICT`` (a
record is stored for the job either way), handed back for ``UNSTORED`` (the outage
budget or the drain ran out), and for ``REFUSED`` (the sink refuses this object for
good, a 4xx for this key or body) the caller gives the job another fate. A failing
write is retried with jittered, doubling delays (50 ms up to 15 s) while the sink has
been failing less than ``sink_outage_seconds``; meanwhile ``sink_down`` pauses
receiving and the health endpoints fail.

On "already stored" the fingerprints decide (docs/formats.md, fingerprints and
conflicts): the same request is a redelivery (``DUPLICATE``); a different request
under the same custom_id gets a ``duplicate_custom_id`` record of its own under
``_conflicts/``, written once, and the stored answer is kept (``CONFLICT``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from qworker.schema import conflict_key, conflict_record, dumps, result_key
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.retry import GaveUp, GiveUp, Retrier
from qworker.worker.sinks.base import PutResult, Sink

log = logging.getLogger(__name__)


class Stored(Enum):
    """The outcome of one ``ResultWriter.store``."""

    WRITTEN = "written"
    DUPLICATE = "duplicate"  # the same request's result was already there
    CONFLICT = "conflict"  # another request's result is there; a conflict record was written
    UNSTORED = "unstored"  # gave up (outage budget spent, or the drain ran out)
    REFUSED = "refused"  # the sink refuses this object for good


@dataclass(slots=True)
class StoreOutcome:
    """What one store did: the outcome, the key, whether a new conflict was recorded,
    and (``REFUSED``) the sink's reason."""

    stored: Stored
    key: str
    new_conflict: bool = False
    refusal: str | None = None


@dataclass(slots=True)
class Conflict:
    """How to record a conflict: its key and record, built by the caller from the fingerprints."""

    key: str
    record: dict[str, Any]


class _Stop(Exception):
    def __init__(self, outcome: Stored, refusal: str | None = None) -> None:
        super().__init__(outcome.value)
        self.outcome = outcome
        self.refusal = refusal


class ResultWriter:
    """Writes records to ``sink`` through ``retrier``; see the module docstring.

    Used from the worker's event loop only.
    """

    def __init__(self, sink: Sink, retrier: Retrier, metrics: WorkerMetrics,
                 prefix: str = "") -> None:
        self.sink = sink
        self.retrier = retrier
        self.metrics = metrics
        self.prefix = prefix

    @property
    def sink_down(self) -> bool:
        """True while the sink keeps failing: finished results wait, so take no new work."""
        return self.retrier.down

    @property
    def failures(self) -> int:
        """Failed sink calls so far."""
        return self.retrier.failures

    async def store_result(
        self,
        custom_id: str,
        batch_id: str | None,
        record: dict[str, Any],
        fingerprint: str | None,
        log_extra: dict[str, Any] | None = None,
    ) -> StoreOutcome:
        """Store one job's result line at its key (docs/formats.md, "Object keys").

        A key holding another request's answer gets this job's ``duplicate_custom_id``
        line under ``_conflicts/`` instead.
        """
        key = result_key(self.prefix, batch_id, custom_id)

        def conflict_for(stored_fingerprint: str | None) -> Conflict:
            assert fingerprint is not None
            return Conflict(
                conflict_key(self.prefix, batch_id, custom_id, fingerprint),
                conflict_record(custom_id, batch_id, fingerprint, stored_fingerprint,
                                record.get("metadata")),
            )

        return await self.store(key, record, fingerprint, conflict_for, log_extra)

    async def store(
        self,
        key: str,
        record: dict[str, Any],
        fingerprint: str | None,
        conflict_for: Callable[[str | None], Conflict] | None = None,
        log_extra: dict[str, Any] | None = None,
    ) -> StoreOutcome:
        """Write ``record`` at ``key`` once; see ``Stored`` for the outcomes."""
        try:
            result = await self._put(key, dumps(record), fingerprint, log_extra)
            if result.written:
                return StoreOutcome(Stored.WRITTEN, key)
            stored = result.stored_fingerprint
            if (fingerprint is None or stored is None or stored == fingerprint
                    or conflict_for is None):
                return StoreOutcome(Stored.DUPLICATE, key)
            conflict = conflict_for(stored)
            written = await self._put(conflict.key, dumps(conflict.record), fingerprint,
                                      log_extra)
        except _Stop as stop:
            return StoreOutcome(stop.outcome, key, refusal=stop.refusal)
        if written.written:
            log.error("duplicate_custom_id: %s holds another request's result (fingerprint %s, "
                      "this one %s); conflict recorded at %s", key, stored[:12],
                      fingerprint[:12], conflict.key, extra=log_extra)
        else:
            log.info("duplicate_custom_id conflict already recorded at %s", conflict.key,
                     extra=log_extra)
        return StoreOutcome(Stored.CONFLICT, key, new_conflict=written.written)

    async def _put(self, key: str, body: bytes, fingerprint: str | None,
                   log_extra: dict[str, Any] | None) -> PutResult:
        async def attempt() -> PutResult:
            started = time.monotonic()
            try:
                result = await self.sink.put(key, body, fingerprint)
            except Exception:
                self.metrics.sink_retries.inc()
                raise
            self.metrics.sink_put_seconds.observe(time.monotonic() - started)
            return result

        try:
            return await self.retrier.call(attempt, f"sink write of {key}", log_extra)
        except GaveUp as gave_up:
            if gave_up.why is GiveUp.REFUSED:
                raise _Stop(Stored.REFUSED, str(gave_up.cause)) from None
            log.error("sink write of %s given up, job left unacked: %s", key, gave_up.cause,
                      extra=log_extra)
            raise _Stop(Stored.UNSTORED) from None
