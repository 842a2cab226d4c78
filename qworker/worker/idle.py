"""``--until-idle``: nothing in flight here AND no pending work at the source (docs/operations.md).

Messages another (or a killed) worker holds are pending work: an idle worker waits for
them. A source that cannot answer is never idle; its failure counts toward the
source's outage budget (the source ``Retrier``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from qworker.worker.retry import Retrier
from qworker.worker.sources.base import Source

log = logging.getLogger(__name__)

_CHECK_EVERY_S = 1.0  # the source is asked at most this often
_TIMEOUT_S = 15.0
_LOG_EVERY_S = 10.0


class IdleCheck:
    """Asks the source for pending work, at most once a second."""

    def __init__(self, source: Source, retrier: Retrier) -> None:
        self.source = source
        self.retrier = retrier
        self._next_check = 0.0
        self._next_log = 0.0

    async def source_drained(self) -> bool:
        """True when the source reports no pending work (see the module docstring)."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + _CHECK_EVERY_S
        try:
            pending = await asyncio.wait_for(self.source.pending_work(), _TIMEOUT_S)
        except Exception as exc:
            log.warning("cannot tell whether the source has pending work: %r", exc)
            self.retrier.failed(exc, "source pending-work question")
            return False
        self.retrier.succeeded()
        if pending > 0:
            if now >= self._next_log:
                self._next_log = now + _LOG_EVERY_S
                log.info("idle here, but the source reports %d pending messages: waiting",
                         pending)
            return False
        return True
