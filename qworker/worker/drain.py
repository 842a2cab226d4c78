"""When to stop: SIGTERM / SIGINT, a spot notice, or the worker's own decision.

``DrainControl`` is the one place that records why and how urgently the worker
stops. The first request starts a graceful drain (stop admitting, give in-flight
jobs ``drain_seconds``); a second signal makes it immediate (abort everything,
never ack unfinished work).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from enum import Enum

log = logging.getLogger(__name__)

# After a second signal the worker aborts, abandons and exits within seconds; if
# something (a hung network close) holds it longer, the process ends hard. Nothing
# unfinished was acked, so a hard exit loses nothing.
HARD_EXIT_AFTER_S = 15.0


class DrainReason(Enum):
    """Why the worker stops."""

    SIGNAL = "signal"
    SPOT = "spot_interruption"
    IDLE = "idle"
    FATAL = "fatal"


class DrainControl:
    """Drain state shared by the worker loop, the signal handlers and the spot poller."""

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self.immediate = asyncio.Event()
        self.reason: DrainReason | None = None

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
        """Signal handler body: first signal drains, a second one stops at once."""
        name = signal.Signals(signum).name
        if self.draining.is_set():
            log.warning("second signal %s: stopping at once", name)
            self.request_immediate(DrainReason.SIGNAL)
            timer = threading.Timer(HARD_EXIT_AFTER_S, os._exit, args=(1,))
            timer.daemon = True
            timer.start()
        else:
            log.warning("signal %s: draining", name)
            self.request(DrainReason.SIGNAL)

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Route SIGTERM and SIGINT to ``on_signal`` on ``loop``."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal, signum)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        """Restore default handling of SIGTERM and SIGINT."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
