"""When to stop (SIGTERM / SIGINT, a spot notice, the worker's own decision) and how long.

``DrainControl`` is the one place that records why and how urgently the worker
stops. The first request starts a graceful drain (stop admitting, give in-flight
jobs ``drain_seconds``); a second signal makes it immediate (abort everything,
never ack unfinished work).

``drain_budget`` is the one definition of how long a whole drain may take
(docs/operations.md, "The drain budget"): every phase, closing the source included,
has its share, and the phases end at fixed times from the drain's start, so the sum
is a hard bound. Kubernetes' ``terminationGracePeriodSeconds`` and the AWS Batch stop
timeout in ``deploy/`` are derived from it (``grace_seconds``; tests/deploy checks).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
from dataclasses import dataclass
from enum import Enum

log = logging.getLogger(__name__)

#: The exit code of a hard exit after a signal: work may be left (``ExitCode.DRAINED``).
_HARD_EXIT_CODE = 75


@dataclass(frozen=True, slots=True)
class DrainBudget:
    """Seconds each drain phase may take, in order; ``total`` bounds the whole drain.

    ``prepare``: messages still being parsed land in the table. ``run``: in-flight jobs
    finish (``QWORKER_DRAIN_SECONDS``). ``abort``: aborted requests come back from the
    engine. ``store``: the last results are written (sink writes stop retrying at its
    end). ``close``: the engine thread stops, the source commits / releases what it holds
    and leaves its group, the sink closes.
    """

    prepare: float
    run: float
    abort: float
    store: float
    close: float

    @property
    def total(self) -> float:
        """The longest a drain takes, from the signal to ``Worker.run`` returning."""
        return self.prepare + self.run + self.abort + self.store + self.close

    @property
    def grace_seconds(self) -> int:
        """What a supervisor must wait between SIGTERM and SIGKILL: the whole drain plus
        ``EXIT_MARGIN_S`` for the summary and the interpreter's exit."""
        return math.ceil(self.total + EXIT_MARGIN_S)

    @property
    def hard_exit_after(self) -> float:
        """After a first signal, the process ends hard (exit 75) this long after it."""
        return self.total + EXIT_MARGIN_S / 2


#: Process exit after ``Worker.run`` returned: the summary line, logging, interpreter.
EXIT_MARGIN_S = 5.0
#: After a second signal: abort, hand back, close; then the process ends hard.
IMMEDIATE_EXIT_AFTER_S = 15.0


def drain_budget(drain_seconds: float) -> DrainBudget:
    """The drain budget for ``QWORKER_DRAIN_SECONDS`` = ``drain_seconds``."""
    return DrainBudget(prepare=2.0, run=max(0.0, drain_seconds), abort=3.0, store=5.0,
                       close=5.0)


class DrainReason(Enum):
    """Why the worker stops."""

    SIGNAL = "signal"
    SPOT = "spot_interruption"
    IDLE = "idle"
    FATAL = "fatal"


class DrainControl:
    """Drain state shared by the worker loop, the signal handlers and the spot poller.

    ``budget`` (from ``drain_budget``) arms the hard-exit timers of ``on_signal``.
    """

    def __init__(self, budget: DrainBudget | None = None) -> None:
        self.draining = asyncio.Event()
        self.immediate = asyncio.Event()
        self.reason: DrainReason | None = None
        self.budget = budget or drain_budget(90.0)
        self._timers: list[threading.Timer] = []

    def request(self, reason: DrainReason) -> None:
        """Start a graceful drain (no-op if one already started)."""
        if self.reason is None:
            self.reason = reason
            log.warning("drain requested: %s", reason.value)
        self.draining.set()

    def request_immediate(self, reason: DrainReason) -> None:
        """Stop now: in-flight jobs are aborted and abandoned, never acked."""
        self.request(reason)
        if not self.immediate.is_set():
            log.warning("immediate stop requested: %s", reason.value)
        self.immediate.set()

    def on_signal(self, signum: int) -> None:
        """Signal handler body: first signal drains, a second one stops at once.

        Either way the process is sure to end with exit 75 (work may be left; nothing
        unfinished was acked, so a hard exit loses nothing): after the drain budget for
        the first signal, ``IMMEDIATE_EXIT_AFTER_S`` after the second.
        """
        name = signal.Signals(signum).name
        if self.draining.is_set():
            log.warning("second signal %s: stopping at once", name)
            self.request_immediate(DrainReason.SIGNAL)
            self._arm(IMMEDIATE_EXIT_AFTER_S)
        else:
            log.warning("signal %s: draining (at most %.0fs)", name, self.budget.total)
            self.request(DrainReason.SIGNAL)
            self._arm(self.budget.hard_exit_after)

    def _arm(self, after: float) -> None:
        timer = threading.Timer(after, _hard_exit)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Route SIGTERM and SIGINT to ``on_signal`` on ``loop``."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal, signum)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        """Restore default handling of SIGTERM and SIGINT.

        Hard-exit timers stay armed: the process's own exit (threads still finishing a
        network call) is part of the budget. ``disarm`` cancels them.
        """
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)

    def disarm(self) -> None:
        """Cancel the hard-exit timers (an embedding process that goes on)."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()


def _hard_exit() -> None:
    log.error("the drain overran its budget: exiting now (exit %d)", _HARD_EXIT_CODE)
    logging.shutdown()
    os._exit(_HARD_EXIT_CODE)
