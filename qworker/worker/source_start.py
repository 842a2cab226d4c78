"""Checking and starting a source: raced against a drain, retried through a ``Retrier``.

A group join or an unreachable broker can hold ``source.start()`` for as long as the
client library likes; a SIGTERM meanwhile must still exit within the drain budget, and
a broker that is down at start is ridden out like any source outage
(docs/operations.md). A ``StartupError`` (a missing queue, topic or dead-letter
target; ``AuthError``: refused credentials) is a configuration error: not retried,
raised after closing the source. ``serve`` runs the source's ``check`` this way before
the model loads, the worker its ``start`` after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from enum import Enum

from qworker.worker.drain import DrainControl
from qworker.worker.failures import StartupError
from qworker.worker.retry import GaveUp, GiveUp, Retrier
from qworker.worker.sources.base import Source

log = logging.getLogger(__name__)


class Started(Enum):
    """How ``start_source`` ended."""

    STARTED = "started"
    DRAINED = "drained"  # a drain cancelled the start (the source may hold work: exit 75)
    UNREACHABLE = "unreachable"  # the outage budget ran out (exit 69)


async def start_source(source: Source, drain: DrainControl, retrier: Retrier,
                       close_s: float, check_only: bool = False) -> Started:
    """Start ``source``; see the module docstring. Closes it (within ``close_s``) unless
    it started. ``retrier`` should wake on ``drain.draining``. ``check_only``: run
    ``source.check()`` instead (before the model loads, docs/operations.md)."""
    what = "source check" if check_only else "source start"

    async def attempt() -> bool:
        start = asyncio.ensure_future(source.check() if check_only else source.start())
        drained = asyncio.ensure_future(drain.draining.wait())
        try:
            await asyncio.wait({start, drained}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller itself cancelled: take the start down with it
            start.cancel()
            raise
        finally:
            drained.cancel()
        if not start.done():
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await start
            return False
        start.result()  # raises what the start raised: classified by the retrier
        return True

    try:
        started = await retrier.call(attempt, what)
    except StartupError:
        await _close(source, close_s)
        raise
    except GaveUp as gave_up:
        await _close(source, close_s)
        if gave_up.why is GiveUp.DRAINED:
            return Started.DRAINED
        log.error("source unreachable at start (%s): %s", what, gave_up.cause)
        return Started.UNREACHABLE
    if not started:
        log.warning("drain requested while the source was starting: not serving")
        await _close(source, close_s)
        return Started.DRAINED
    return Started.STARTED


async def _close(source: Source, budget: float) -> None:
    try:
        await asyncio.wait_for(source.close(), max(0.5, budget))
    except TimeoutError:
        log.warning("source did not close within %.1fs after its start", budget)
    except Exception as exc:
        log.warning("closing the source after its start failed: %r", exc)
