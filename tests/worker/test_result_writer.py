"""The result writer: the one retry loop around the sink (S3 on moto through the fault proxy)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

pytest.importorskip("boto3")

from qworker.testing.faultproxy import FaultProxy
from qworker.worker.aws import ClientOptions, make_client
from qworker.worker.drain import DrainControl
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.result_writer import Conflict, ResultWriter, Stored
from qworker.worker.retry import Retrier
from qworker.worker.sinks.s3 import S3Sink
from tests.fixtures.servers import boto_client


def _writer(endpoint: str, bucket: str, outage_s: float = 30.0, read_timeout: float = 2.0,
            ) -> tuple[ResultWriter, list[str], WorkerMetrics]:
    opts = ClientOptions(endpoint_url=endpoint, connect_timeout=1, read_timeout=read_timeout)
    sink = S3Sink(make_client("s3", opts), bucket)
    exhausted: list[str] = []
    metrics = WorkerMetrics()
    retrier = Retrier(Outage("sink", outage_s, metrics.set_problem),
                      Backoff(first=0.01, cap=0.05, rng=random.Random(0)),
                      wake=DrainControl().immediate, on_exhausted=exhausted.append)
    writer = ResultWriter(sink, retrier, metrics)
    return writer, exhausted, metrics


def _store(writer: ResultWriter, key: str, record: dict[str, Any],
           fingerprint: str | None = None, **kw: Any) -> Stored:
    async def go() -> Stored:
        try:
            return (await writer.store(key, record, fingerprint, **kw)).stored
        finally:
            await writer.sink.close()

    return asyncio.run(go())


def _get(endpoint: str, bucket: str, key: str) -> bytes:
    return boto_client("s3", endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


def test_a_run_of_503s_and_500s_is_retried_through(moto_server: str, s3_bucket: str) -> None:
    with FaultProxy(moto_server, seed=1) as proxy:
        proxy.fail_next(3, status=503)
        proxy.fail_next(2, status=500)
        writer, exhausted, _ = _writer(proxy.url, s3_bucket)
        assert _store(writer, "retry/ok.json", {"ok": 1}) is Stored.WRITTEN
        stats = proxy.stats
    assert stats["errors_503"] == 3 and stats["errors_500"] == 2
    assert writer.failures == 5 and exhausted == []
    assert _get(moto_server, s3_bucket, "retry/ok.json") == b'{"ok":1}'


def test_connection_resets_are_retried_through(moto_server: str, s3_bucket: str) -> None:
    with FaultProxy(moto_server) as proxy:
        proxy.fail_next(2, status=0)
        writer, _, _ = _writer(proxy.url, s3_bucket)
        assert _store(writer, "reset.json", {"r": 1}) is Stored.WRITTEN
        assert proxy.stats["resets"] == 2


def test_a_read_timeout_is_retried_and_lands_exactly_once(moto_server: str, s3_bucket: str) -> None:
    # Every request is slower than the client's read timeout until latency is lifted:
    # the first attempt may still reach S3 after the client gave up; a retry then sees
    # 412 with the same fingerprint: a duplicate, which still means "the result is there".
    with FaultProxy(moto_server, latency=1.5) as proxy:
        writer, _, _ = _writer(proxy.url, s3_bucket, read_timeout=0.5)

        async def go() -> Stored:
            task = asyncio.create_task(writer.store("slow.json", {"s": 1}, "fp-slow"))
            await asyncio.sleep(0.6)
            proxy.configure(latency=0.0)
            return (await task).stored

        outcome = asyncio.run(go())
        assert writer.failures >= 1
    assert outcome in (Stored.WRITTEN, Stored.DUPLICATE)
    assert _get(moto_server, s3_bucket, "slow.json") == b'{"s":1}'


def test_the_writer_gives_up_only_when_the_outage_budget_is_spent(
    moto_server: str, s3_bucket: str
) -> None:
    with FaultProxy(moto_server, error_rate=1.0) as proxy:
        writer, exhausted, metrics = _writer(proxy.url, s3_bucket, outage_s=1.5)
        started = time.monotonic()
        assert _store(writer, "never.json", {"n": 1}) is Stored.UNSTORED
        took = time.monotonic() - started
    assert 1.5 <= took < 5
    assert len(exhausted) == 1 and "sink failing" in exhausted[0]
    assert "sink" in metrics.problems  # health failed meanwhile


def test_same_fingerprint_is_a_duplicate_and_another_writes_one_conflict_record(
    moto_server: str, s3_bucket: str
) -> None:
    writer, _, _ = _writer(moto_server, s3_bucket)

    def conflict_for(stored: str | None) -> Conflict:
        return Conflict(f"b/_conflicts/doc-{'fp-b'[:12]}.json", {"conflict": stored})

    async def go() -> list[tuple[Stored, bool]]:
        try:
            outcomes = [await writer.store("b/doc.json", {"a": 1}, "fp-a", conflict_for),
                        await writer.store("b/doc.json", {"a": 2}, "fp-a", conflict_for),
                        await writer.store("b/doc.json", {"b": 1}, "fp-b", conflict_for),
                        await writer.store("b/doc.json", {"b": 2}, "fp-b", conflict_for)]
            return [(o.stored, o.new_conflict) for o in outcomes]
        finally:
            await writer.sink.close()

    assert asyncio.run(go()) == [(Stored.WRITTEN, False), (Stored.DUPLICATE, False),
                                 (Stored.CONFLICT, True), (Stored.CONFLICT, False)]
    assert _get(moto_server, s3_bucket, "b/doc.json") == b'{"a":1}'  # never replaced
    assert _get(moto_server, s3_bucket, "b/_conflicts/doc-fp-b.json") == b'{"conflict":"fp-a"}'
