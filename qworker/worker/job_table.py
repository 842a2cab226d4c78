"""Where every unacked job of a worker is, and why the worker aborted it.

A received message is in exactly one place until its fate is recorded (ack,
abandon, dead letter): being prepared or stored (a background *task*), *ready* at the
admission gate, in a *suspect* group waiting to be retried after a failed engine step,
*deferred* (it failed alone, but no other job has yet shown that the engine works),
or *in flight* inside the engine (by request id, with ``by_message`` for revocations).
``JobTable`` holds those containers; the worker loop moves jobs between them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from qworker.worker.admission import Growth
from qworker.worker.requests import Prepared
from qworker.worker.sources.base import Message

log = logging.getLogger(__name__)


class AbortReason(Enum):
    """Why the worker aborted a request inside the engine."""

    EXPIRED = "expired"  # its deadline passed: a batch_expired record
    DRAIN = "drain"  # the worker stops: handed back to the source
    REVOKED = "revoked"  # Kafka moved its partition elsewhere: dropped here
    STEP_FAILED = "step_failed"  # an engine step failed: retried (docs/operations.md)


@dataclass(slots=True)
class ReadyJob:
    """A parsed, tokenized job whose message is not acked yet."""

    msg: Message
    prepared: Prepared

    @property
    def custom_id(self) -> str:
        """The job's custom_id (for log lines)."""
        return self.prepared.job.custom_id


@dataclass(slots=True)
class InFlightJob:
    """A job inside the engine, keyed by its engine request id."""

    ready: ReadyJob
    request_id: str
    growth: Growth
    abort_reason: AbortReason | None = None


class JobTable:
    """The containers of one worker's unacked jobs; used from its event loop only."""

    def __init__(self) -> None:
        self.ready: deque[ReadyJob] = deque()
        self.suspects: deque[list[ReadyJob]] = deque()
        self.deferred: list[ReadyJob] = []
        self.inflight: dict[str, InFlightJob] = {}
        self.by_message: dict[str, str] = {}
        self.tasks: set[asyncio.Task[Any]] = set()

    @property
    def busy(self) -> int:
        """Unacked jobs: at the gate, suspected, in the engine, or in a background task."""
        return (len(self.ready) + sum(len(g) for g in self.suspects) + len(self.deferred)
                + len(self.inflight) + len(self.tasks))

    def admit(self, job: ReadyJob, request_id: str, growth: Growth) -> InFlightJob:
        """Record that ``job`` entered the engine as ``request_id``."""
        entry = InFlightJob(job, request_id, growth)
        self.inflight[request_id] = entry
        self.by_message[job.msg.message_id] = request_id
        return entry

    def finish(self, request_id: str) -> InFlightJob | None:
        """Take ``request_id`` out of the engine's set; None if unknown (already taken)."""
        entry = self.inflight.pop(request_id, None)
        if entry is not None:
            self.by_message.pop(entry.ready.msg.message_id, None)
        return entry

    def take_all_inflight(self) -> list[InFlightJob]:
        """Every job in the engine, removed from the table."""
        entries = list(self.inflight.values())
        self.inflight.clear()
        self.by_message.clear()
        return entries

    def take_waiting(self) -> list[ReadyJob]:
        """Every job at the gate, suspected or deferred, removed from the table."""
        waiting = ([job for group in self.suspects for job in group] + self.deferred
                   + list(self.ready))
        self.suspects.clear()
        self.deferred = []
        self.ready.clear()
        return waiting

    def revoke(self, message_ids: Iterable[str]) -> list[InFlightJob]:
        """Forget waiting jobs of ``message_ids``; return their in-flight ones (to abort)."""
        revoked = set(message_ids)
        self.ready = deque(j for j in self.ready if j.msg.message_id not in revoked)
        groups = ([j for j in g if j.msg.message_id not in revoked] for g in self.suspects)
        self.suspects = deque(g for g in groups if g)
        self.deferred = [j for j in self.deferred if j.msg.message_id not in revoked]
        out = []
        for mid in revoked:
            rid = self.by_message.get(mid)
            entry = self.inflight.get(rid) if rid is not None else None
            if entry is not None:
                out.append(entry)
        return out

    def spawn(self, coro: Coroutine[Any, Any, Any],
              on_done: Callable[[asyncio.Task[Any]], None] | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as a background task counted in ``busy`` until it ends."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self.tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("job task failed", exc_info=t.exception())
            if on_done is not None:
                on_done(t)

        task.add_done_callback(done)
        return task
