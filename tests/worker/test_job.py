"""The job record and its state machine (qworker/worker/job.py) and the table indexing it
(qworker/worker/job_table.py): one record per message, moves only along the table."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("orjson")

from qworker.engine.sampling_params import SamplingParams
from qworker.schema import Job as JobSpec
from qworker.schema import JobKind
from qworker.worker.job import OPEN, TRANSITIONS, Job, JobState, TransitionError
from qworker.worker.job_table import JobTable
from qworker.worker.sources.base import Message

S = JobState


def _msg(i: int) -> Message:
    return Message(b"{}", f"file:{i}", None, i, 0.0)


def test_every_state_is_in_the_table_and_nothing_leaves_settled() -> None:
    assert set(TRANSITIONS) == set(JobState)
    assert TRANSITIONS[S.SETTLED] == frozenset() and S.SETTLED not in OPEN
    assert S.SETTLING not in OPEN
    for state in OPEN:  # a job can be handed back or answered from anywhere
        job = Job(1, _msg(1), state=state)
        job.move(S.SETTLING)
        job.move(S.SETTLED)


@pytest.mark.parametrize(("start", "bad"), [(S.RECEIVED, S.RUNNING), (S.READY, S.PREPARING),
                                            (S.ANSWERING, S.READY), (S.SETTLED, S.SETTLING),
                                            (S.SETTLING, S.READY)])
def test_a_move_outside_the_table_is_refused(start: JobState, bad: JobState) -> None:
    with pytest.raises(TransitionError):
        Job(1, _msg(1), state=start).move(bad)


def test_the_deadline_check_lives_on_the_record() -> None:
    job = Job(1, _msg(1))
    assert not job.expired()
    job.spec = JobSpec("c", JobKind.COMPLETION, SamplingParams(), prompt="x",
                       deadline=time.time() - 1)
    assert job.expired() and not job.expired(now=job.deadline - 5)


def test_the_table_indexes_follow_the_records_states() -> None:
    table = JobTable()
    jobs = [table.receive(_msg(i)) for i in range(4)]
    assert table.busy == 4 and len({j.seq for j in jobs}) == 4
    for job in jobs:
        table.move(job, S.PREPARING)
        table.move(job, S.READY)
    assert list(table.ready) == jobs
    jobs[2].request_id = "r2"
    table.move(jobs[2], S.RUNNING)
    assert list(table.ready) == [jobs[0], jobs[1], jobs[3]] and table.running == {"r2": jobs[2]}
    table.move(jobs[0], S.ANSWERING)  # answered from the gate: leaves the queue
    jobs[1].request_id = "r1"
    table.move(jobs[1], S.RUNNING)
    table.suspect([[jobs[2]], [jobs[1]]])  # a failed step sends both back
    assert table.running == {} and [g[0] for g in table.suspects] == [jobs[2], jobs[1]]
    assert list(table.ready) == [jobs[3]]
    assert table.waiting() == [jobs[2], jobs[1], jobs[3]]
    table.move(jobs[1], S.DEFERRED)
    assert table.deferred == [jobs[1]] and len(table.suspects) == 1
    for job in jobs:
        table.move(job, S.SETTLING)
        table.settled(job)
    assert table.busy == 0 and not table.ready and not table.suspects and not table.deferred
