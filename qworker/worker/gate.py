"""The admission gate: ready jobs into the engine thread while the KV pool can take them.

``Gate.room`` says how many messages to ask the source for; ``Gate.admit`` submits
ready jobs in order while ``Admission.fits`` (the KV projection) allows. Jobs sent back
by a failed engine step go first, one suspect group at a time and alone in the engine
(``isolated``), so the job that breaks steps is found by halving its group
(docs/operations.md, "Engine failures"). A job the engine refuses, or whose deadline
passed at the gate, goes to ``on_reject`` for its error line.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable

from qworker.worker.admission import Admission, Growth
from qworker.worker.engine_thread import EngineLike, EngineThread
from qworker.worker.job_table import JobTable, ReadyJob
from qworker.worker.requests import expired_error

log = logging.getLogger(__name__)


class Gate:
    """Moves jobs from ``table.ready`` / ``table.suspects`` into the engine; loop only."""

    def __init__(self, table: JobTable, admission: Admission, engine: EngineLike,
                 thread: EngineThread, block_size: int,
                 on_reject: Callable[[ReadyJob, BaseException], None]) -> None:
        self.table = table
        self.admission = admission
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
        return self.admission.room(self.engine.stats(), self.thread.pending_blocks, active)

    def released(self, request_id: str, growth: Growth) -> None:
        """A job left the engine (finished, aborted, or taken back after a failed step)."""
        self.isolated.discard(request_id)
        self.admission.released(growth, self.block_size)

    def admit(self) -> None:
        """Submit suspects (a group alone) or ready jobs while the pool can take them."""
        table, thread = self.table, self.thread
        if self.isolated:
            return
        if table.suspects:
            if table.inflight:
                return  # let the engine empty first: the group must run alone
            for job in table.suspects.popleft():
                rid = self._submit(job, None)
                if rid is not None:
                    self.isolated.add(rid)
            return
        while table.ready:
            job = table.ready[0]
            n_tokens = len(job.prepared.token_ids)
            growth = self._growth(job)
            admitted = [entry.growth for entry in table.inflight.values()]
            need = max(1, math.ceil(n_tokens / self.block_size))
            if not self.admission.fits(self.engine.stats(), thread.pending_blocks, need,
                                       admitted, growth, thread.steps, self.block_size):
                return
            table.ready.popleft()
            self._submit(job, growth)

    def _growth(self, job: ReadyJob) -> Growth:
        params = job.prepared.job.params
        return self.admission.growth(len(job.prepared.token_ids), params.max_tokens, params.n,
                                     self.engine.max_model_len, self.thread.steps)

    def _submit(self, job: ReadyJob, growth: Growth | None) -> str | None:
        prepared, spec = job.prepared, job.prepared.job
        expired = expired_error(spec)
        if expired is not None:
            self._on_reject(job, expired)
            return None
        growth = growth or self._growth(job)
        request_id = uuid.uuid4().hex
        try:
            self.thread.submit(request_id, prepared.text, prepared.token_ids, spec.params,
                               job.msg.received_at)
        except Exception as exc:  # any rejection becomes the job's record
            self._on_reject(job, exc)
            return None
        self.admission.observe_prompt(len(prepared.token_ids), self.block_size)
        self.table.admit(job, request_id, growth)
        self.admission.admitted(growth, self.block_size)
        log.debug("admitted as %s", request_id,
                  extra={"custom_id": spec.custom_id, "message_id": job.msg.message_id})
        return request_id
