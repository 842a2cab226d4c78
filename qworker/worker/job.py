"""One record per received message: its states, the allowed transitions, its fate.

Every message a source hands the worker becomes one ``Job`` the moment it is received
and stays that one record until ``settle`` gives it its ``Fate``
(``qworker.worker.settle``). Where a job is, and why, is read from ``job.state``:

====================  =======================================================
``RECEIVED``          taken from the source, not yet parsed
``PREPARING``         parsed, validated and tokenized on the prep pool
``READY``             waiting at the admission gate
``RUNNING``           inside the engine (``request_id``); ``abort`` says why the
                      worker aborted it, if it did
``SUSPECT``           back from a failed engine step, to run again alone
``DEFERRED``          failed alone; waits until another job shows the engine works
``ANSWERING``         its result (or error) record is built and stored
``DEAD_LETTERING``    not a job: on its way to the dead-letter target
``SETTLING``          ``settle`` is telling the source its fate
``SETTLED``           done here; ``fate`` says how
====================  =======================================================

``TRANSITIONS`` is the whole state machine: any state before ``SETTLING`` may also go
to ``SETTLING`` (a job can be handed back, revoked or answered from anywhere), and
nothing leaves ``SETTLED``. ``Job.move`` refuses anything else (a bug, never input).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from qworker.worker.sources.base import Message

if TYPE_CHECKING:
    from qworker.schema import Job as JobSpec
    from qworker.worker.admission import Growth


class JobState(Enum):
    """Where a received message is (see the module docstring)."""

    RECEIVED = "received"
    PREPARING = "preparing"
    READY = "ready"
    RUNNING = "running"
    SUSPECT = "suspect"
    DEFERRED = "deferred"
    ANSWERING = "answering"
    DEAD_LETTERING = "dead_lettering"
    SETTLING = "settling"
    SETTLED = "settled"


S = JobState
#: Allowed moves besides ``-> SETTLING`` (open to every state before it).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.RECEIVED: frozenset({S.PREPARING}),
    S.PREPARING: frozenset({S.READY, S.ANSWERING, S.DEAD_LETTERING}),
    S.READY: frozenset({S.RUNNING, S.ANSWERING}),
    S.RUNNING: frozenset({S.ANSWERING, S.SUSPECT, S.DEFERRED}),
    S.SUSPECT: frozenset({S.RUNNING, S.DEFERRED, S.ANSWERING}),
    S.DEFERRED: frozenset({S.SUSPECT, S.ANSWERING}),
    # The sink refused the record itself (a permanent 4xx): the message is dead-lettered.
    S.ANSWERING: frozenset({S.DEAD_LETTERING}),
    S.DEAD_LETTERING: frozenset(),
    S.SETTLING: frozenset({S.SETTLED}),
    S.SETTLED: frozenset(),
}
#: States whose job has not started settling: ``settle`` may be called on them.
OPEN = frozenset(set(JobState) - {S.SETTLING, S.SETTLED})
#: States in which the job is the engine's or waits for it (answering it means removing
#: it from the admission gate first).
AT_GATE = frozenset({S.READY, S.SUSPECT, S.DEFERRED})


class Fate(Enum):
    """How a job left the worker; each calls the source once (or, REVOKED, not at all)."""

    ACKED = "acked"  # its record is stored: acknowledged (commit / delete / done)
    HANDED_BACK = "handed_back"  # abandoned unfinished: the source delivers it again
    DEAD_LETTERED = "dead_lettered"  # at the dead-letter target or the sink's _dead_letters/
    REVOKED = "revoked"  # its Kafka partition moved: the new owner answers it


class AbortReason(Enum):
    """Why the worker aborted a job's request inside the engine."""

    EXPIRED = "expired"  # its deadline passed: a batch_expired record
    DRAIN = "drain"  # the worker stops: handed back to the source
    REVOKED = "revoked"  # Kafka moved its partition elsewhere: dropped here


class TransitionError(RuntimeError):
    """A move the state machine does not allow: a bug in the worker, never bad input."""


@dataclass(slots=True, eq=False)
class Job:
    """Everything the worker knows about one received message; see the module docstring.

    The ids are known once parsed (``custom_id`` None: not a job, or not parsed yet).
    ``spec`` is the validated request, ``token_ids`` its prompt (``input_ids``, one
    list per input, for an embedding job); ``solo_failures``
    counts engine steps that failed while it ran alone and ``completions_seen`` how many
    jobs the worker had completed at the first of them. Times are ``time.monotonic``.
    Used from the worker's event loop only (the prep pool fills a copy's fields).
    """

    seq: int
    msg: Message
    state: JobState = JobState.RECEIVED
    fate: Fate | None = None
    custom_id: str | None = None
    batch_id: str | None = None
    fingerprint: str | None = None
    spec: JobSpec | None = None
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    input_ids: list[list[int]] | None = None
    request_id: str | None = None
    growth: Growth | None = None
    abort: AbortReason | None = None
    solo_failures: int = 0
    completions_seen: int = 0
    #: Records this job tried to store (its result, then an error record).
    records: int = 0
    #: The record's status once acked: "success", an error code, "duplicate", ...
    status: str | None = None
    received: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    settled: float | None = None

    def move(self, state: JobState) -> None:
        """Change state along ``TRANSITIONS`` (or to ``SETTLING`` from an open state)."""
        if state is self.state:
            return
        allowed = state in TRANSITIONS[self.state] or (
            state is JobState.SETTLING and self.state in OPEN)
        if not allowed:
            raise TransitionError(f"job {self.seq} ({self.msg.message_id}): "
                                  f"{self.state.value} -> {state.value} is not allowed")
        self.state = state

    @property
    def deadline(self) -> float | None:
        """The job's ``deadline`` (unix seconds), once parsed."""
        return self.spec.deadline if self.spec is not None else None

    def expired(self, now: float | None = None) -> bool:
        """True once the job's deadline (if any) has passed; ``now`` is unix seconds."""
        deadline = self.deadline
        return deadline is not None and deadline <= (time.time() if now is None else now)

    @property
    def is_open(self) -> bool:
        """True until ``settle`` starts on it."""
        return self.state in OPEN

    def log_ids(self) -> dict[str, Any]:
        """``extra`` for a log line about this job: custom_id and message id."""
        return {"custom_id": self.custom_id, "message_id": self.msg.message_id}
