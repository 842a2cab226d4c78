"""The one retry primitive (qworker/worker/retry.py): verdicts, budgets, drain deadlines."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from qworker.worker.failures import Refused, SourceUnavailableError, StartupError
from qworker.worker.outage import Backoff, Outage
from qworker.worker.retry import GaveUp, GiveUp, Retrier, Verdict, classify


class _Fatal(SourceUnavailableError):
    fatal = True


def test_classify_tells_transient_refused_fatal_and_configuration_apart() -> None:
    assert classify(ConnectionError("reset")) is Verdict.TRANSIENT
    assert classify(TimeoutError()) is Verdict.TRANSIENT
    assert classify(Refused("too large for the queue")) is Verdict.REFUSED
    assert classify(_Fatal("cannot decode")) is Verdict.FATAL
    assert classify(StartupError("queue missing")) is Verdict.CONFIG


def _retrier(budget: float, **kw: object) -> tuple[Retrier, list[str]]:
    exhausted: list[str] = []
    retrier = Retrier(Outage("dep", budget), Backoff(0.01, 0.02, random.Random(0)),
                      on_exhausted=exhausted.append, **kw)  # type: ignore[arg-type]
    return retrier, exhausted


def test_transient_failures_are_retried_until_success() -> None:
    retrier, exhausted = _retrier(10)
    calls = []

    async def op() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionError("down")
        return "ok"

    assert asyncio.run(retrier.call(op, "op")) == "ok"
    assert len(calls) == 4 and retrier.failures == 3 and exhausted == []
    assert retrier.outage.since is None  # the outage ended with the success


def test_a_refusal_is_not_retried_and_not_an_outage() -> None:
    retrier, exhausted = _retrier(10)
    calls = []

    async def op() -> None:
        calls.append(1)
        raise Refused("message must be shorter than 1024 bytes")

    with pytest.raises(GaveUp) as info:
        asyncio.run(retrier.call(op, "dead letter"))
    assert info.value.why is GiveUp.REFUSED and len(calls) == 1
    assert retrier.outage.since is None and exhausted == []


def test_the_budget_ends_retrying_and_reports_once() -> None:
    retrier, exhausted = _retrier(0.3)

    async def op() -> None:
        raise ConnectionError("down")

    started = time.monotonic()
    with pytest.raises(GaveUp) as info:
        asyncio.run(retrier.call(op, "op"))
    assert info.value.why is GiveUp.EXHAUSTED and 0.3 <= time.monotonic() - started < 3
    assert len(exhausted) == 1 and "dep failing" in exhausted[0]


def test_a_deadline_or_a_wake_gives_up_without_spending_the_budget() -> None:
    until = time.monotonic() + 0.2
    retrier, exhausted = _retrier(60, deadline=lambda: until)

    async def op() -> None:
        raise ConnectionError("down")

    with pytest.raises(GaveUp) as info:
        asyncio.run(retrier.call(op, "op"))
    assert info.value.why is GiveUp.DRAINED and exhausted == []

    async def woken() -> GiveUp:
        wake = asyncio.Event()
        retrier = Retrier(Outage("dep", 60), Backoff(5.0, 5.0), wake=wake)
        asyncio.get_running_loop().call_later(0.1, wake.set)
        try:
            await retrier.call(op, "op")
        except GaveUp as gave_up:
            return gave_up.why
        raise AssertionError("no give-up")

    started = time.monotonic()
    assert asyncio.run(woken()) is GiveUp.DRAINED and time.monotonic() - started < 2


def test_a_configuration_error_propagates_as_itself() -> None:
    retrier, _ = _retrier(10)

    async def op() -> None:
        raise StartupError("kafka topic 'x' does not exist")

    with pytest.raises(StartupError):
        asyncio.run(retrier.call(op, "start"))


def _client_error(code: str, status: int = 403) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "no"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "ReceiveMessage")


def test_refused_credentials_and_untrusted_tls_are_auth_failures_even_when_wrapped() -> None:
    import ssl

    pytest.importorskip("botocore")
    from aiokafka.errors import SaslAuthenticationFailed, TopicAuthorizationFailedError

    from qworker.worker.failures import AuthError

    for exc in (AuthError("refused"), SaslAuthenticationFailed("bad password"),
                TopicAuthorizationFailedError("jobs"),
                ssl.SSLCertVerificationError(1, "certificate verify failed"),
                *(_client_error(code) for code in ("AccessDenied", "InvalidClientTokenId",
                                                   "SignatureDoesNotMatch", "ExpiredToken"))):
        assert classify(exc) is Verdict.AUTH, exc
        wrapped = SourceUnavailableError("sqs receive failed")
        wrapped.__cause__ = exc
        assert classify(wrapped) is Verdict.AUTH, exc
    assert classify(_client_error("SlowDown", 503)) is Verdict.TRANSIENT
    assert classify(_client_error("NoSuchKey", 404)) is Verdict.TRANSIENT


def test_an_auth_failure_is_a_configuration_error_at_start_and_fatal_once_serving() -> None:
    pytest.importorskip("botocore")
    from qworker.worker.failures import AuthError

    serving = False
    fatal: list[str] = []
    retrier, exhausted = _retrier(60, running=lambda: serving, on_fatal=fatal.append)
    calls: list[int] = []

    async def op() -> None:
        calls.append(1)
        raise SourceUnavailableError("receive failed") from _client_error("ExpiredToken")

    with pytest.raises(AuthError, match="ExpiredToken"):
        asyncio.run(retrier.call(op, "source start"))
    assert len(calls) == 1  # not retried
    serving = True
    with pytest.raises(GaveUp) as gave_up:
        asyncio.run(retrier.call(op, "source receive"))
    assert gave_up.value.why is GiveUp.FATAL and len(calls) == 2
    assert len(fatal) == 1 and not exhausted  # exit 69 at once, not after the budget
