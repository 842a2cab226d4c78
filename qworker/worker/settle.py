"""How a job ends: ``settle(job, fate)``, the one place that calls the source, and the paths to it.

Every received message is settled exactly once (docs/reliability.md, "The job
lifecycle"): ``ACKED`` once its record is stored, ``HANDED_BACK`` (abandoned, delivered
again later), ``DEAD_LETTERED`` (the dead-letter target, or the sink's
``_dead_letters/``) or ``REVOKED`` (its Kafka partition moved). ``settle`` is the only
caller of the source's ``ack`` / ``abandon`` / ``dead_letter`` and the only place
that counts outcomes in the metrics and the run summary.

The paths there: ``answer`` stores a record (``answer_error`` builds an error record
first: "answer this job with an error" is one line from anywhere), ``finish`` builds a
served job's record, ``dead_letter`` sends a message that is no job. Each runs as a
task under a supervisor: any exception on one job's path settles *that* job (its
``invalid_request`` or ``server_error`` record; a dead letter when it has no
custom_id; handed back when even that fails) and never reaches its batch-mates or the
worker loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from qworker.engine.outputs import RequestOutput
from qworker.schema import error_of, error_record, error_record_for
from qworker.schema.peek import peek_ids
from qworker.worker.dead_letters import DeadLetters, Delivered
from qworker.worker.job import Fate, Job, JobState
from qworker.worker.job_table import JobTable
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.requests import job_error, record_for
from qworker.worker.result_writer import ResultWriter, Stored, StoreOutcome
from qworker.worker.sources.base import Message, Source
from qworker.worker.summary import RunSummary
from qworker.worker.tasks import Tasks

log = logging.getLogger(__name__)

S = JobState
#: Records one job may try to store (its result, then its error) before it is handed back.
MAX_RECORDS = 2


def record_status(record: dict[str, Any]) -> str:
    """``success`` or the error code of a result line."""
    error = error_of(record)
    return "success" if error is None else str(error.get("code") or "engine_error")


class Settler:
    """Ends jobs; see the module docstring. Event loop only.

    ``pool`` runs record building; ``on_settled()`` is called after every settle (the
    worker's progress event).
    """

    def __init__(self, table: JobTable, source: Source, writer: ResultWriter,
                 dead_letters: DeadLetters, metrics: WorkerMetrics, summary: RunSummary,
                 tasks: Tasks, pool: concurrent.futures.Executor, model_name: str,
                 decode: Callable[[int], str] | None,
                 on_settled: Callable[[], None] = lambda: None) -> None:
        self.table = table
        self.source = source
        self.writer = writer
        self.dead_letters = dead_letters
        self.metrics = metrics
        self.summary = summary
        self.tasks = tasks
        self.pool = pool
        self.model_name = model_name
        self.decode = decode
        self._on_settled = on_settled

    # ------------------------------------------------------------ receiving

    def received(self, msgs: list[Message]) -> list[Job]:
        """One new record per message, counted as received."""
        self.summary.received += len(msgs)
        self.metrics.jobs_received.inc(len(msgs))
        return [self.table.receive(msg) for msg in msgs]

    # ------------------------------------------------------------ the supervisor

    def spawn(self, jobs: list[Job], coro: Coroutine[Any, Any, Any], doing: str) -> None:
        """Run ``coro`` for ``jobs`` as a task; a failure settles those jobs (``fail``)."""
        self.tasks.spawn(self._guarded(jobs, coro, doing), name=doing)

    async def _guarded(self, jobs: list[Job], coro: Coroutine[Any, Any, Any],
                       doing: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise  # the drain hands back whatever is still unsettled
        except Exception as exc:
            for job in jobs:
                if job.is_open:
                    self.fail(job, exc, doing)

    def fail(self, job: Job, exc: BaseException, doing: str) -> None:
        """Settle ``job`` after ``exc`` on its path: its record, a dead letter, or hand back."""
        self.summary.job_failures += 1
        log.error("failed to %s: %r", doing, exc, extra=job.log_ids(),
                  exc_info=(type(exc), exc, exc.__traceback__))
        if not job.is_open:
            return
        if job.state is S.DEAD_LETTERING or job.records >= MAX_RECORDS:
            self.settle_later(job, Fate.HANDED_BACK)
            return
        if job.custom_id is None:  # failed before it was parsed: its ids, read unparsed
            ids = peek_ids(job.msg.body)
            if ids.custom_id is not None and ids.batch_known:
                job.custom_id, job.batch_id = ids.custom_id, ids.batch_id
        if job.custom_id is None:
            self.dead_letter(job, f"qworker could not {doing}: {job_error(exc, doing)}")
        else:
            self.answer_error(job, job_error(exc, doing))

    # ------------------------------------------------------------ answering

    def answer_error(self, job: Job, exc: BaseException) -> None:
        """Answer ``job`` with the error record of ``exc`` (from any open state)."""
        metadata = job.spec.metadata if job.spec is not None else None
        assert job.custom_id is not None, "a job without custom_id is dead-lettered"
        record = error_record_for(job.custom_id, job.batch_id, exc, metadata)
        log.warning("%s: %s", record_status(record), exc, extra=job.log_ids())
        self.answer(job, record)

    def answer(self, job: Job, record: dict[str, Any]) -> None:
        """Store ``record`` as ``job``'s answer, then settle it (from any open state)."""
        self.table.move(job, S.ANSWERING)
        self.spawn([job], self._store(job, record), "store its record")

    def finish(self, job: Job, output: RequestOutput, expired: bool = False) -> None:
        """Build the record of what the engine returned for ``job`` and store it."""
        self.table.move(job, S.ANSWERING)
        self.spawn([job], self._finish(job, output, expired), "build its record")

    async def _finish(self, job: Job, output: RequestOutput, expired: bool) -> None:
        assert job.spec is not None
        loop = asyncio.get_running_loop()
        record = await loop.run_in_executor(self.pool, record_for, job.spec, output,
                                            self.model_name, self.decode, expired)
        await self._store(job, record)

    async def _store(self, job: Job, record: dict[str, Any]) -> None:
        assert job.custom_id is not None
        job.records += 1
        status = record_status(record)
        outcome = await self.writer.store_result(job.custom_id, job.batch_id, record,
                                                 job.fingerprint, job.log_ids())
        if outcome.stored is Stored.UNSTORED:
            await self.settle(job, Fate.HANDED_BACK)
        elif outcome.stored is Stored.REFUSED:
            why = f"the sink refused this job's record: {outcome.refusal}"
            if job.records < MAX_RECORDS:
                log.error("%s; storing an error record instead", why, extra=job.log_ids())
                await self._store(job, error_record(
                    job.custom_id, job.batch_id, "engine_error", why,
                    job.spec.metadata if job.spec is not None else None))
            else:
                self.table.move(job, S.DEAD_LETTERING)
                await self.settle(job, Fate.DEAD_LETTERED, reason=why)
        else:
            await self.settle(job, Fate.ACKED, outcome=outcome, status=status)

    # ------------------------------------------------------------ dead letters

    def dead_letter(self, job: Job, reason: str) -> None:
        """Send a message that is no job to the dead-letter target (or the sink)."""
        log.warning("dead letter: %s", reason, extra=job.log_ids())
        self.table.move(job, S.DEAD_LETTERING)
        self.spawn([job], self.settle(job, Fate.DEAD_LETTERED, reason=reason), "dead-letter it")

    # ------------------------------------------------------------ settle

    def settle_later(self, job: Job, fate: Fate) -> None:
        """``settle`` from synchronous code (an engine callback, a revocation)."""
        if job.is_open:
            self.table.move(job, S.SETTLING)
            self.tasks.spawn(self.settle(job, fate), name=f"settle {fate.value}")

    async def settle(self, job: Job, fate: Fate, *, reason: str = "",
                     outcome: StoreOutcome | None = None, status: str | None = None,
                     force: bool = False) -> None:
        """End ``job`` with ``fate``: the one call to the source, the counts; see the module.

        ``force``: hand back a job whose earlier settle was cancelled (drain only).
        """
        if job.state is S.SETTLED or (job.state is S.SETTLING and job.fate is not None
                                      and not force):
            self.summary.settled_twice += 1
            log.error("job settled twice (%s, then %s): ignored", job.fate, fate,
                      extra=job.log_ids())
            return
        self.table.move(job, S.SETTLING)
        job.fate = fate
        msg = job.msg
        delivered: Delivered | None = None
        if fate is Fate.DEAD_LETTERED:
            try:
                delivered, reason = await self.dead_letters.deliver(
                    msg, reason, lambda: self.source.dead_letter(msg, reason))
            except Exception as exc:  # a failure of ours: the message is delivered again
                log.error("dead letter failed: %r", exc, extra=job.log_ids())
                delivered = Delivered.NOWHERE
            if delivered is Delivered.SINK:
                await self._source_call("ack", self.source.ack(msg), job)
            elif delivered is Delivered.NOWHERE:
                job.fate = fate = Fate.HANDED_BACK
                await self._source_call("abandon", self.source.abandon(msg), job)
        elif fate is Fate.ACKED:
            await self._source_call("ack", self.source.ack(msg), job)
        elif fate is Fate.HANDED_BACK:
            await self._source_call("abandon", self.source.abandon(msg), job)
        self._count(job, fate, outcome, status, delivered)
        job.move(S.SETTLED)
        job.settled = time.monotonic()
        self.table.settled(job)
        self._on_settled()

    async def _source_call(self, what: str, call: Awaitable[None], job: Job) -> None:
        try:
            await call
        except Exception as exc:  # the message comes back later; its record (if any) stays
            self.summary.source_call_errors += 1
            log.error("source %s failed (the message will be delivered again): %r", what, exc,
                      extra=job.log_ids())

    def _count(self, job: Job, fate: Fate, outcome: StoreOutcome | None, status: str | None,
               delivered: Delivered | None) -> None:
        self.summary.fates[fate.value] += 1
        ids = job.log_ids()
        if fate is Fate.ACKED:
            status = status or "success"
            if outcome is not None and outcome.stored is Stored.DUPLICATE:
                self.summary.duplicates += 1
                self.metrics.jobs_duplicate.inc()
                log.info("result already stored (duplicate) at %s", outcome.key, extra=ids)
            elif outcome is not None and outcome.stored is Stored.CONFLICT:
                self.summary.conflicts += 1
                if outcome.new_conflict:
                    self.metrics.jobs_conflict.inc()
                status = "duplicate_custom_id"
            elif outcome is not None:
                log.info("%s -> %s", status, outcome.key, extra=ids)
            job.status = status
            self.summary.completed[status] += 1
            self.metrics.job_completed(status, job.batch_id)
        elif fate is Fate.DEAD_LETTERED:
            self.summary.dead_lettered += 1
            if delivered is Delivered.SINK:
                self.summary.dead_lettered_to_sink += 1
            self.metrics.jobs_dead_lettered.inc()
        elif fate is Fate.HANDED_BACK:
            self.summary.abandoned += 1
            log.info("handed back to the source", extra=ids)
        else:
            self.summary.revoked += 1
            log.info("dropped: partition revoked", extra=ids)
