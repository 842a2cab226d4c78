"""The worker's one retry primitive: outage budget, drain deadline, jittered backoff, verdicts.

Every call the worker makes to something outside it (a sink write, a dead letter, a
receive, a source start, the pending-work question, an SQS delete) goes through a
``Retrier`` (docs/operations.md, "When something fails"). A failure is first
*classified* (``classify``):

- ``TRANSIENT``: the dependency is unreachable or throttling: retried with jittered,
  doubling delays while its ``Outage`` lasts less than the budget; then the worker
  stops (exit 69);
- ``REFUSED``: the dependency answered, and refuses *this item* for good (a dead letter
  too large for the queue, an object S3 will not take): never retried and not an
  outage; the caller gives that one item another fate;
- ``FATAL``: retrying cannot help the worker at all (a Kafka batch it cannot decode):
  exit 69 at once;
- ``CONFIG``: a configuration problem (a missing queue, topic or dead-letter target):
  one line, exit 1. The original exception propagates.
- ``AUTH``: credentials refused or a certificate not trusted (``auth_failure``: Kafka
  SASL and authorization errors, ``ssl.SSLCertVerificationError``, AWS AccessDenied /
  InvalidClientTokenId / SignatureDoesNotMatch / ExpiredToken). Never retried: before
  the worker serves (``running()`` False) it is a configuration error like ``CONFIG``
  (raised as an ``AuthError``, exit 1); once it serves, the same credentials worked, so
  they were rotated, expired or revoked since: ``FATAL`` (exit 69 at once), and the next
  process reads them afresh (and exits 1 if they are wrong).

``classify`` is the one place that decides; a dependency's own errors are turned into
``Refused`` / ``StartupError`` / ``SourceUnavailableError`` by the source or sink that
knows them. A ``Retrier`` gives up with ``GaveUp`` (its ``why``), never by returning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, TypeVar

from qworker.worker.failures import (
    AuthError,
    Refused,
    SourceUnavailableError,
    StartupError,
    auth_failure,
)
from qworker.worker.outage import Backoff, Outage

log = logging.getLogger(__name__)

T = TypeVar("T")


class Verdict(Enum):
    """What one failure means (see the module docstring)."""

    TRANSIENT = "transient"
    REFUSED = "refused"
    FATAL = "fatal"
    CONFIG = "config"
    AUTH = "auth"


def classify(exc: BaseException) -> Verdict:
    """The verdict on ``exc``; the single place where failures are told apart.

    Authentication and authorization failures (SASL, TLS verification, AWS AccessDenied,
    found in ``exc`` or its causes) come first, then configuration errors.
    """
    if auth_failure(exc) is not None:
        return Verdict.AUTH
    if isinstance(exc, StartupError):
        return Verdict.CONFIG
    if isinstance(exc, Refused):
        return Verdict.REFUSED
    if isinstance(exc, SourceUnavailableError) and exc.fatal:
        return Verdict.FATAL
    return Verdict.TRANSIENT


class GiveUp(Enum):
    """Why a ``Retrier`` stopped trying."""

    EXHAUSTED = "exhausted"  # the outage budget is spent (the worker stops: exit 69)
    DRAINED = "drained"  # the drain deadline passed or an immediate stop was asked
    REFUSED = "refused"  # the dependency refuses this item for good
    FATAL = "fatal"  # retrying cannot help (exit 69 at once)


class GaveUp(Exception):
    """A ``Retrier.call`` that ended without success; ``cause`` is the last failure."""

    def __init__(self, why: GiveUp, cause: BaseException | None) -> None:
        super().__init__(f"{why.value}: {cause}")
        self.why = why
        self.cause = cause


class Retrier:
    """Retries calls to one dependency within its ``Outage`` budget; event loop only.

    ``wake`` (an event) ends a backoff wait early and gives up the call: the worker's
    "stop now" (or, for receiving, "draining"). ``deadline()`` (monotonic) bounds the
    retries of a draining worker; ``stop()`` True gives up after the current failure
    (a source closing). ``on_exhausted(why)`` / ``on_fatal(why)`` are called once per
    call that ends so. ``running()`` True once the worker serves: an ``AUTH`` verdict is
    then fatal rather than a configuration error (default: never running, i.e. start).
    Concurrent calls share the outage clock.
    """

    def __init__(
        self,
        outage: Outage,
        backoff: Backoff | None = None,
        *,
        wake: asyncio.Event | None = None,
        deadline: Callable[[], float | None] | None = None,
        stop: Callable[[], bool] | None = None,
        on_exhausted: Callable[[str], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        classify: Callable[[BaseException], Verdict] = classify,
        running: Callable[[], bool] | None = None,
    ) -> None:
        self.outage = outage
        self.backoff = backoff or Backoff()
        self.wake = wake
        self._deadline = deadline or (lambda: None)
        self._stop = stop or (lambda: False)
        self._on_exhausted = on_exhausted
        self._on_fatal = on_fatal
        self.classify = classify
        self._running = running or (lambda: False)
        #: Failed attempts over the life of this retrier (for metrics and tests).
        self.failures = 0

    @property
    def down(self) -> bool:
        """True while the dependency has been failing for ``outage.DOWN_AFTER_S``."""
        return self.outage.down

    async def call(self, op: Callable[[], Awaitable[T]], what: str,
                   log_extra: dict[str, Any] | None = None) -> T:
        """``await op()`` until it succeeds; raises ``GaveUp`` (or the CONFIG exception)."""
        attempt = 0
        while True:
            try:
                result = await op()
            except Exception as exc:
                attempt += 1
                await self._after_failure(exc, attempt, what, log_extra)
                continue
            self.outage.recovered()
            return result

    def succeeded(self) -> None:
        """Record a success of a call made outside ``call`` (the outage is over)."""
        self.outage.recovered()

    def failed(self, exc: BaseException, what: str) -> bool:
        """Record one failure of a call made outside ``call``, without waiting.

        Returns False when the caller should stop (budget spent, or fatal); raises the
        exception itself for a CONFIG verdict. ``on_exhausted`` / ``on_fatal`` are called.
        """
        verdict = self._verdict(exc, what)
        self.failures += 1
        if verdict is Verdict.FATAL:
            self._fatal(f"{what} cannot go on: {exc}")
            return False
        if verdict is Verdict.REFUSED:
            return True
        down_for = self.outage.failed(exc)
        if self.outage.exhausted():
            self._exhausted(f"{self.outage.name} failing for {down_for:.0f}s: {exc}")
            return False
        return True

    async def _after_failure(self, exc: Exception, attempt: int, what: str,
                             log_extra: dict[str, Any] | None) -> None:
        verdict = self._verdict(exc, what)
        self.failures += 1
        if verdict is Verdict.REFUSED:
            log.warning("%s refused for good (not retried): %s", what, exc, extra=log_extra)
            raise GaveUp(GiveUp.REFUSED, exc) from exc
        if verdict is Verdict.FATAL:
            self._fatal(f"{what} cannot go on: {exc}")
            raise GaveUp(GiveUp.FATAL, exc) from exc
        now = time.monotonic()
        down_for = self.outage.failed(exc, now)
        if self.outage.exhausted(now):
            log.error("%s given up after %.0fs of failures: %s", what, down_for, exc,
                      extra=log_extra)
            self._exhausted(f"{self.outage.name} failing for {down_for:.0f}s: {exc}")
            raise GaveUp(GiveUp.EXHAUSTED, exc) from exc
        deadline = self._deadline()
        woken = self.wake is not None and self.wake.is_set()
        if woken or self._stop() or (deadline is not None and now >= deadline):
            log.warning("%s given up (stopping): %s", what, exc, extra=log_extra)
            raise GaveUp(GiveUp.DRAINED, exc) from exc
        delay = self.backoff.delay(attempt)
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - now))
        log.debug("%s failed (attempt %d), again in %.2fs: %s", what, attempt, delay, exc,
                  extra=log_extra)
        await self._sleep(delay)

    def _verdict(self, exc: BaseException, what: str) -> Verdict:
        """``classify(exc)``; raises for a configuration error, an ``AUTH`` one is FATAL
        once running (see the module docstring)."""
        verdict = self.classify(exc)
        if verdict is Verdict.AUTH:
            if self._running():
                return Verdict.FATAL
            if isinstance(exc, AuthError):
                raise exc
            cause = auth_failure(exc)
            raise AuthError(f"{what}: credentials or TLS refused: "
                            f"{_one_line(cause if cause is not None else exc)}") from None
        if verdict is Verdict.CONFIG:
            raise exc
        return verdict

    async def _sleep(self, delay: float) -> None:
        if self.wake is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), delay)

    def _exhausted(self, why: str) -> None:
        if self._on_exhausted is not None:
            self._on_exhausted(why)

    def _fatal(self, why: str) -> None:
        if self._on_fatal is not None:
            self._on_fatal(why)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
