"""Which batches held here were cancelled: the batch's ``_cancel.json`` read through the sink.

``qworker cancel`` writes ``<prefix>/<batch>/_cancel.json`` once (docs/formats.md,
"Batch lifecycle"). A worker learns of it two ways:

- on receipt: before a prepared job goes to the admission gate, its batch is looked up
  unless that was done within the interval (``lookup_new``), so a job sent after its
  batch was cancelled is answered ``batch_cancelled`` without running;
- while it holds a batch's jobs: ``refresh`` looks again for each held batch at most
  every ``interval`` seconds (``QWORKER_CANCEL_CHECK_SECONDS``).

Lookups run through ``Sink.get`` (the S3 sink's thread pool, a thread for the file
sink), never on the event loop, each bounded by ``timeout``. A failed lookup is not
fatal and not a cancellation: it is logged and the batch is looked up again in the next
regular round (no retry loop of its own: a missed marker is only news delayed). A marker never
goes away, so a cancelled batch stays cancelled: those are remembered in a bounded
LRU (``max_known``); when other batches were last looked up is remembered while they
are held or for one ``interval``, so each batch costs at most one lookup per interval.
Jobs without a ``batch_id`` (the ``default`` batch) are never looked up: ``cancel``
needs a produced batch. Event loop only.

What "not started" means: a job not yet submitted to the engine (waiting at the
admission gate, ``READY``, or back from a failed step, ``SUSPECT`` / ``DEFERRED``) is
answered ``batch_cancelled`` (``answer_waiting``); a job inside the engine, scheduled
or still queued there, runs to its normal end. ``watch_held`` is the worker's helper
task: the periodic rounds, and answering the waiting jobs of the batches they find
cancelled; the preparer answers the jobs it prepares (qworker/worker/preparing.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from qworker.errors import BatchCancelledError
from qworker.schema import cancel_key
from qworker.worker.job import AT_GATE, Job
from qworker.worker.job_table import JobTable
from qworker.worker.sinks.base import Sink

log = logging.getLogger(__name__)

#: Cancelled batch ids remembered at most (each a short string).
MAX_KNOWN_CANCELLED = 4096
#: Seconds one marker lookup may take before it counts as failed (tried next round).
LOOKUP_TIMEOUT_S = 10.0
#: The same for the receipt check, which holds the batch's first jobs back meanwhile.
RECEIPT_TIMEOUT_S = 2.0


class CancelWatch:
    """Cancel markers of the batches a worker holds; see the module docstring."""

    def __init__(self, sink: Sink, prefix: str, interval: float,
                 timeout: float = LOOKUP_TIMEOUT_S,
                 max_known: int = MAX_KNOWN_CANCELLED) -> None:
        self.sink = sink
        self.prefix = prefix
        self.interval = interval
        self.timeout = timeout
        self.max_known = max_known
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        #: batch -> time.monotonic() of its last lookup (done or failed)
        self._looked: dict[str, float] = {}
        self._pending: dict[str, asyncio.Task[bool | None]] = {}
        self.lookups = 0
        self.failures = 0

    def is_cancelled(self, batch_id: str | None) -> bool:
        """True once ``batch_id``'s marker was seen here."""
        if batch_id is None or batch_id not in self._cancelled:
            return False
        self._cancelled.move_to_end(batch_id)
        return True

    async def lookup_new(self, batch_ids: Iterable[str | None],
                         now: float | None = None) -> None:
        """Look up the batches not looked up here within ``interval`` (the receipt check)."""
        now = time.monotonic() if now is None else now
        new = {b for b in batch_ids if b is not None and self._due(b, now)}
        await self._lookup_all(new, min(self.timeout, RECEIPT_TIMEOUT_S), now)

    async def refresh(self, held: Iterable[str | None], now: float | None = None) -> set[str]:
        """Look again for each ``held`` batch last looked up ``interval`` ago or more.

        Returns the held batches known cancelled (newly or before). Batches neither held
        nor looked up within ``interval`` are forgotten (the cancelled ones stay in the
        LRU), so a batch is looked up at most once per ``interval`` however its jobs come.
        """
        now = time.monotonic() if now is None else now
        held_set = {b for b in held if b is not None}
        for batch, at in list(self._looked.items()):
            if batch not in held_set and now - at >= self.interval:
                del self._looked[batch]
        await self._lookup_all({b for b in held_set if self._due(b, now)}, self.timeout, now)
        return {b for b in held_set if b in self._cancelled}

    def _due(self, batch: str, now: float) -> bool:
        if batch in self._cancelled:
            return False  # a marker never goes away
        at = self._looked.get(batch)
        return at is None or now - at >= self.interval

    async def _lookup_all(self, batches: set[str], timeout: float, now: float) -> None:
        for batch in batches:
            self._looked[batch] = now  # done or failed, the next look is an interval away
        if batches:
            await asyncio.gather(*(self._lookup(b, timeout) for b in batches))

    async def _lookup(self, batch: str, timeout: float) -> None:
        task = self._pending.get(batch)
        if task is None:  # one lookup per batch at a time, shared by its waiters
            task = asyncio.ensure_future(self._read(batch, timeout))
            self._pending[batch] = task
            task.add_done_callback(lambda _t: self._pending.pop(batch, None))
        cancelled = await asyncio.shield(task)
        if cancelled:
            self._remember(batch)

    async def _read(self, batch: str, timeout: float) -> bool | None:
        """Whether the marker exists; None when the lookup failed (logged)."""
        self.lookups += 1
        key = cancel_key(self.prefix, batch)
        try:
            data = await asyncio.wait_for(self.sink.get(key), timeout)
        except Exception as exc:
            self.failures += 1
            log.warning("cannot read the cancel marker of batch %s at %s (trying again in "
                        "%.0fs): %r", batch, key, self.interval, exc)
            return None
        if data is not None:
            log.info("batch %s is cancelled (%s): its jobs not yet in the engine get "
                     "batch_cancelled", batch, key)
        return data is not None

    def _remember(self, batch: str) -> None:
        self._cancelled[batch] = None
        self._cancelled.move_to_end(batch)
        while len(self._cancelled) > self.max_known:
            self._cancelled.popitem(last=False)


def cancelled_error(batch_id: str | None) -> BatchCancelledError:
    """The ``batch_cancelled`` error of a job of ``batch_id`` that had not started."""
    return BatchCancelledError(f"batch {batch_id} was cancelled before this job started")


def answer_waiting(table: JobTable, cancelled: set[str],
                   answer: Callable[[Job, BaseException], None]) -> int:
    """Answer every job of a ``cancelled`` batch still waiting for the engine
    (``READY``, ``SUSPECT``, ``DEFERRED``) ``batch_cancelled``; jobs in the engine run on.
    Returns how many were answered."""
    waiting = [job for job in table if job.state in AT_GATE and job.batch_id in cancelled]
    for job in waiting:
        answer(job, cancelled_error(job.batch_id))
    return len(waiting)


async def watch_held(watch: CancelWatch, table: JobTable,
                     answer: Callable[[Job, BaseException], None],
                     paused: Callable[[], bool]) -> None:
    """The worker's helper task: ``refresh`` the held batches, answer their waiting jobs.

    Wakes every second (or every ``interval`` if shorter); ``paused()`` true (a drain)
    skips a round. Runs until cancelled.
    """
    tick = min(1.0, watch.interval)
    while True:
        await asyncio.sleep(tick)
        if paused():
            continue
        try:
            await _round(watch, table, answer, paused)
        except Exception:  # a bug here must not end the watch (or the worker)
            log.exception("cancel watch round failed; trying again next round")


async def _round(watch: CancelWatch, table: JobTable,
                 answer: Callable[[Job, BaseException], None],
                 paused: Callable[[], bool]) -> None:
    held = {job.batch_id for job in table if job.batch_id is not None}
    if not held:
        return
    cancelled = await watch.refresh(held)
    if cancelled and not paused():
        answered = answer_waiting(table, cancelled, answer)
        if answered:
            log.info("%d waiting jobs of cancelled batches %s answered batch_cancelled",
                     answered, sorted(cancelled))
