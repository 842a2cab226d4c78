"""Received messages into jobs: parsed, validated and tokenized on the prep pool.

``Preparer.start`` turns a receive batch into ``PREPARING`` jobs and prepares them off
the event loop (``requests.prepare``: JSON parsing, chat templates and tokenization
never block the loop, which also keeps Kafka and SQS heartbeats going). Each outcome
moves its own job: ``READY`` for the gate, an error record, or a dead letter; one
message's failure is that message's outcome, never its batch-mates'. A job of a batch
cancelled (``CancelWatch``, looked up on first sight) is answered ``batch_cancelled``
instead of going to the gate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from qworker.worker.cancel_watch import CancelWatch, cancelled_error
from qworker.worker.engine_thread import EngineLike
from qworker.worker.job import Job, JobState
from qworker.worker.job_table import JobTable
from qworker.worker.requests import Prepared, Unserved, prepare
from qworker.worker.served_models import ServedModels
from qworker.worker.settle import Settler
from qworker.worker.sources.base import Message

log = logging.getLogger(__name__)

Outcome = Prepared | Unserved | Exception


class Preparer:
    """Prepares received messages; ``on_ready()`` runs after each batch (admission)."""

    def __init__(self, engine: EngineLike, max_job_bytes: int,
                 pool: concurrent.futures.Executor, table: JobTable, settler: Settler,
                 on_ready: Callable[[], None], served: ServedModels | None = None,
                 cancels: CancelWatch | None = None) -> None:
        self.engine = engine
        self.cancels = cancels
        self.max_job_bytes = max_job_bytes
        self.served = served
        self.pool = pool
        self.table = table
        self.settler = settler
        self._on_ready = on_ready

    def start(self, msgs: list[Message]) -> None:
        """Record ``msgs`` as received and prepare them in the background."""
        jobs = self.settler.received(msgs)
        for job in jobs:
            self.table.move(job, JobState.PREPARING)
        self.settler.spawn(jobs, self._prepare(jobs), "parse and prepare it")

    def prepare_all(self, msgs: list[Message]) -> list[Outcome]:
        """On the prep pool: each message's outcome, an exception included as itself."""
        outcomes: list[Outcome] = []
        for msg in msgs:
            try:
                outcomes.append(prepare(self.engine, msg.body, self.max_job_bytes,
                                        size=msg.size, ids=msg.ids, served=self.served))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    async def _prepare(self, jobs: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self.pool, self.prepare_all,
                                              [job.msg for job in jobs])
        if self.cancels is not None:  # a batch not looked up lately: cancelled already?
            await self.cancels.lookup_new(o.job.batch_id for o in outcomes
                                          if isinstance(o, Prepared))
        for job, outcome in zip(jobs, outcomes, strict=True):
            if job.is_open:
                self._prepared(job, outcome)
        self._on_ready()

    def _prepared(self, job: Job, outcome: Outcome) -> None:
        if isinstance(outcome, Exception):
            self.settler.fail(job, outcome, "parse and prepare it")
        elif isinstance(outcome, Prepared):
            spec = outcome.job
            job.custom_id, job.batch_id = spec.custom_id, spec.batch_id
            job.fingerprint, job.spec = outcome.fingerprint, spec
            job.text, job.token_ids = outcome.text, outcome.token_ids
            job.input_ids = outcome.input_ids
            if self.cancels is not None and self.cancels.is_cancelled(spec.batch_id):
                self.settler.answer_error(job, cancelled_error(spec.batch_id))
                return
            self.table.move(job, JobState.READY)
        elif outcome.dead_letter is not None:
            self.settler.dead_letter(job, outcome.dead_letter)
        else:
            assert outcome.record is not None
            job.custom_id, job.batch_id = outcome.custom_id, outcome.batch_id
            job.fingerprint = outcome.fingerprint
            log.warning("%s: not served", outcome.code, extra=job.log_ids())
            self.settler.answer(job, outcome.record)
