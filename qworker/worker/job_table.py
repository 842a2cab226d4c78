"""The index over a worker's unsettled ``Job`` records (qworker/worker/job.py).

A job's ``state`` says where it is; the table keeps the few orderings the worker needs
to act on states quickly: the admission queue (``ready``, in arrival order), the
suspect groups of a failed step (``suspects``, tried in order), the ``deferred``
jobs, and the jobs in the engine by request id (``running``). ``move`` is the one
place a job changes state, so the indexes always agree with the records; ``settled``
drops a record once its fate is known. Event loop only.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from qworker.worker.job import Job, JobState
from qworker.worker.sources.base import Message

S = JobState


class JobTable:
    """Every job received and not yet settled, with its state indexes."""

    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self.ready: deque[Job] = deque()
        self.suspects: deque[list[Job]] = deque()
        self.deferred: list[Job] = []
        self.running: dict[str, Job] = {}
        self._seq = itertools.count(1)

    @property
    def busy(self) -> int:
        """Jobs received here and not settled, in any state."""
        return len(self.jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self.jobs.values()))

    def receive(self, msg: Message) -> Job:
        """A new record for ``msg`` (state ``RECEIVED``)."""
        job = Job(next(self._seq), msg)
        self.jobs[job.seq] = job
        return job

    def move(self, job: Job, state: JobState) -> None:
        """Change ``job``'s state and keep the indexes in step with it.

        Entering ``SUSPECT`` goes through ``suspect`` (jobs enter it as groups).
        """
        self._unindex(job)
        job.move(state)
        if state is S.READY:
            self.ready.append(job)
        elif state is S.RUNNING:
            assert job.request_id is not None
            self.running[job.request_id] = job
        elif state is S.DEFERRED:
            self.deferred.append(job)
        elif state is S.SUSPECT:
            self.suspects.append([job])

    def suspect(self, groups: Iterable[list[Job]], front: bool = True) -> None:
        """Queue ``groups`` of jobs to run again, each group alone (first ones first)."""
        groups = [g for g in groups if g]
        for group in groups:
            for job in group:
                self._unindex(job)
                job.move(S.SUSPECT)
        if front:
            self.suspects.extendleft(reversed(groups))
        else:
            self.suspects.extend(groups)

    def settled(self, job: Job) -> None:
        """Forget ``job``: its fate is known (called by ``settle`` only)."""
        self._unindex(job)
        self.jobs.pop(job.seq, None)

    def in_state(self, *states: JobState) -> list[Job]:
        """The jobs in any of ``states``, oldest first."""
        return [job for job in self.jobs.values() if job.state in states]

    def waiting(self) -> list[Job]:
        """Jobs that have not started in the engine: suspected, deferred, then ready."""
        return ([job for group in self.suspects for job in group] + list(self.deferred)
                + list(self.ready))

    def _unindex(self, job: Job) -> None:
        state = job.state
        if state is S.READY:
            with contextlib.suppress(ValueError):
                self.ready.remove(job)
        elif state is S.RUNNING:
            if job.request_id is not None and self.running.get(job.request_id) is job:
                del self.running[job.request_id]
        elif state is S.DEFERRED:
            self.deferred = [j for j in self.deferred if j is not job]
        elif state is S.SUSPECT:
            groups = ([j for j in g if j is not job] for g in self.suspects)
            self.suspects = deque(g for g in groups if g)
