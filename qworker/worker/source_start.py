"""Starting a source: raced against a drain, retried through an outage.

A group join or an unreachable broker can hold ``source.start()`` for as long as the
client library likes; a SIGTERM meanwhile must still exit within the drain budget, and
a broker that is down at start is ridden out like any source outage
(docs/operations.md). A ``StartupError`` (a missing queue or topic) is not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from enum import Enum

from qworker.worker.drain import DrainControl
from qworker.worker.failures import StartupError
from qworker.worker.outage import Backoff, Outage
from qworker.worker.sources.base import Source

log = logging.getLogger(__name__)

_CLOSE_S = 5.0  # longest wait to close a source whose start did not complete


class Started(Enum):
    """How ``start_source`` ended."""

    STARTED = "started"
    DRAINED = "drained"  # a drain cancelled the start (the source may hold work: exit 75)
    UNREACHABLE = "unreachable"  # the outage budget ran out (exit 69)


async def start_source(source: Source, drain: DrainControl, outage: Outage,
                       backoff: Backoff, drain_seconds: float) -> Started:
    """Start ``source``; see the module docstring. Closes it unless it started.

    Raises ``StartupError`` (after closing the source) for a configuration problem.
    """
    attempt = 0
    while True:
        start = asyncio.ensure_future(source.start())
        drained = asyncio.ensure_future(drain.draining.wait())
        try:
            await asyncio.wait({start, drained}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller itself cancelled: take the start down with it
            start.cancel()
            raise
        finally:
            drained.cancel()
        if not start.done():
            log.warning("drain requested while the source was starting: not serving")
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await start
            await _close(source, drain_seconds)
            return Started.DRAINED
        try:
            start.result()
            outage.recovered()
            return Started.STARTED
        except StartupError:
            await _close(source, drain_seconds)
            raise
        except Exception as exc:  # unreachable for now: retried within the budget
            attempt += 1
            outage.failed(exc)
            if outage.exhausted():
                log.error("source unreachable at start: %s", exc)
                await _close(source, drain_seconds)
                return Started.UNREACHABLE
            log.warning("source start failed (attempt %d), retrying: %s", attempt, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain.draining.wait(), backoff.delay(attempt))


async def _close(source: Source, drain_seconds: float) -> None:
    budget = min(_CLOSE_S, max(1.0, drain_seconds))
    try:
        await asyncio.wait_for(source.close(), budget)
    except TimeoutError:
        log.warning("source did not close within %.1fs after its start", budget)
    except Exception as exc:
        log.warning("closing the source after its start failed: %r", exc)
