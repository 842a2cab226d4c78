"""What happens to the jobs of a failed engine step (docs/operations.md, "Engine failures").

A failed step does not fail its jobs: they go back through the gate in *suspect*
groups, halved at every failure and run with nothing else in the engine, until the job
that breaks steps is found alone. That job gets its ``engine_error`` line only after
failing alone ``max_job_attempts`` times and after some other job completed since its
first solo failure (proof that the engine itself works); without that proof it is
*deferred* while other jobs run. Failed steps in a row with no job completing in
between, beyond what bisection and the solo attempts explain, mean the engine itself is
broken (exit 70). Pure bookkeeping over the ``JobTable``: no I/O, event loop only.
"""

from __future__ import annotations

import math

from qworker.worker.job import Job, JobState
from qworker.worker.job_table import JobTable

#: Failed steps in a row, beyond what bisecting the jobs and retrying the last one
#: alone explain, before the engine counts as broken.
MAX_STEP_FAILURES = 3


class StepFailures:
    """The failure streak and the verdicts; see the module docstring."""

    def __init__(self, table: JobTable, max_job_attempts: int) -> None:
        self.table = table
        self.max_job_attempts = max_job_attempts
        self.streak = 0  # failed steps since a job last completed
        self.completions = 0  # jobs the engine completed normally
        self._width = 1  # jobs in flight at the first failure of the streak

    @property
    def limit(self) -> int:
        """Failed steps in a row that mean a broken engine, for the current streak."""
        return MAX_STEP_FAILURES + math.ceil(math.log2(self._width)) + self.max_job_attempts

    @property
    def broken(self) -> bool:
        """True once the streak reached ``limit``: the worker stops with exit 70."""
        return self.streak >= self.limit

    def completed(self) -> None:
        """A job completed normally: the streak ends; deferred jobs get their next try."""
        self.completions += 1
        self.streak = 0
        if self.table.deferred:
            self.table.suspect(([job] for job in list(self.table.deferred)), front=False)

    def failed(self, group: list[Job], in_flight: int) -> list[Job]:
        """A step failed with ``group`` (its retryable jobs) among ``in_flight`` requests.

        Requeues them (halved, alone again, or deferred) and returns the jobs whose
        verdict is now ``engine_error``.
        """
        if self.streak == 0:
            self._width = max(1, in_flight)
        self.streak += 1
        if len(group) > 1:
            half = len(group) // 2
            self.table.suspect([group[:half], group[half:]], front=True)
            return []
        if not group:
            return []
        job = group[0]
        if job.solo_failures == 0:
            job.completions_seen = self.completions
        job.solo_failures += 1
        if job.solo_failures < self.max_job_attempts:
            self.table.suspect([[job]], front=True)
            return []
        if self.completions == job.completions_seen:
            # No other job completed since this one first failed alone: the engine itself
            # may be broken. Let the others run (a completion brings it back); if they
            # fail too, that is a broken engine; if there are none, ``judge_deferred``.
            self.table.move(job, JobState.DEFERRED)
            return []
        return [job]

    def judge_deferred(self) -> list[Job]:
        """Nothing else is left to run: the deferred jobs' verdict is ``engine_error``."""
        return list(self.table.deferred)
