"""The admission gate: ready jobs into the engine thread while the KV pool can take them.

``Gate.room`` says how many messages to ask the source for; ``Gate.admit`` submits
ready jobs in order while ``Admission.fits`` (the KV projection) allows. Jobs sent back
by a failed engine step go first, one suspect group at a time and alone in the engine
(``isolated``), so the job that breaks steps is found by halving its group
(docs/operations.md, "Engine failures"). A job the engine refuses, or whose deadline
passed at the gate (``Job.expired``), goes to ``on_reject`` for its error line. An
embedding engine's jobs are admitted by tokens in flight instead (``tokens``,
``TokenAdmission``): they hold no KV blocks.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable

from qworker.errors import BatchExpiredError
from qworker.worker.admission import Admission, Growth
from qworker.worker.engine_thread import EngineLike, EngineThread
from qworker.worker.job import Job, JobState
from qworker.worker.job_table import JobTable
from qworker.worker.requests import job_error
from qworker.worker.token_admission import TokenAdmission

log = logging.getLogger(__name__)


class Gate:
    """Moves jobs from ``table.ready`` / ``table.suspects`` into the engine; loop only."""

    def __init__(self, table: JobTable, admission: Admission, engine: EngineLike,
                 thread: EngineThread, block_size: int,
                 on_reject: Callable[[Job, BaseException], None],
                 tokens: TokenAdmission | None = None) -> None:
        self.table = table
        self.admission = admission
        self.tokens = tokens
        self.engine = engine
        self.thread = thread
        self.block_size = block_size
        self._on_reject = on_reject
        #: Request ids of the suspect group under test: nothing else enters meanwhile.
        self.isolated: set[str] = set()

    def room(self) -> int:
        """How many messages to receive now (0 while jobs wait at the gate)."""
        table = self.table
        if table.ready or table.suspects or self.isolated:
            return 0
        # Deferred jobs wait for others to run: they must not take those others' places.
        active = table.busy - len(table.deferred)
        if self.tokens is not None:
            return self.tokens.room(active)
        return self.admission.room(self.engine.stats(), self.thread.pending_blocks, active)

    def released(self, job: Job) -> None:
        """``job`` left the engine (finished, aborted, or taken back after a failed step)."""
        if job.request_id is not None:
            self.isolated.discard(job.request_id)
            if self.tokens is not None:
                self.tokens.released(job.request_id)
        if job.growth is not None:
            self.admission.released(job.growth, self.block_size)
            job.growth = None

    def admit(self) -> None:
        """Submit suspects (a group alone) or ready jobs while the pool can take them."""
        table, thread = self.table, self.thread
        if self.isolated:
            return
        if table.suspects:
            if table.running:
                return  # let the engine empty first: the group must run alone
            with thread.batch():
                for job in list(table.suspects[0]):
                    if self._submit(job, None):
                        assert job.request_id is not None
                        self.isolated.add(job.request_id)
            return
        with thread.batch():  # the jobs admitted together are prefilled together
            while table.ready:
                job = table.ready[0]
                if self.tokens is not None:
                    if not self.tokens.fits(_tokens(job)):
                        return
                    self._submit(job, None)
                    continue
                growth = self._growth(job)
                admitted = [j.growth for j in table.running.values() if j.growth is not None]
                need = max(1, math.ceil(len(job.token_ids) / self.block_size))
                if not self.admission.fits(self.engine.stats(), thread.pending_blocks, need,
                                           admitted, growth, thread.steps, self.block_size):
                    return
                self._submit(job, growth)

    def _growth(self, job: Job) -> Growth:
        assert job.spec is not None
        params = job.spec.params
        return self.admission.growth(len(job.token_ids), params.max_tokens, params.n,
                                     self.engine.max_model_len, self.thread.steps)

    def _submit(self, job: Job, growth: Growth | None) -> bool:
        """Hand ``job`` to the engine; False when it was rejected (its record follows)."""
        assert job.spec is not None
        if job.expired():
            self._on_reject(job, BatchExpiredError(
                f"deadline {job.deadline:.0f} passed before the job started"))
            return False
        # An embedding request holds no KV blocks: nothing for the KV projection.
        growth = None if job.input_ids is not None else growth or self._growth(job)
        request_id = uuid.uuid4().hex
        try:
            if job.input_ids is not None:
                self.thread.submit_embedding(request_id, job.input_ids, job.spec.dimensions,
                                             job.msg.received_at)
            else:
                self.thread.submit(request_id, job.text, job.token_ids, job.spec.params,
                                   job.msg.received_at)
        except Exception as exc:  # any rejection becomes the job's record
            self._on_reject(job, job_error(exc, "submit it to the engine"))
            return False
        job.request_id, job.growth, job.admitted = request_id, growth, time.monotonic()
        self.table.move(job, JobState.RUNNING)
        if growth is not None:
            self.admission.observe_prompt(len(job.token_ids), self.block_size)
            self.admission.admitted(growth, self.block_size)
        if self.tokens is not None:
            self.tokens.admitted(request_id, _tokens(job))
        log.debug("admitted as %s", request_id, extra=job.log_ids())
        return True


def _tokens(job: Job) -> int:
    """A job's prompt tokens: all inputs of an embedding job together."""
    if job.input_ids is not None:
        return sum(len(ids) for ids in job.input_ids)
    return len(job.token_ids)
