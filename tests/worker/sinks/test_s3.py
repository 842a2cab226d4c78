"""The S3 sink against a real moto server, directly and through the fault proxy."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("boto3")

from qworker.testing.faultproxy import FaultProxy
from qworker.worker.aws import ClientOptions, make_client
from qworker.worker.sinks.s3 import (
    S3Sink,
    S3WriteError,
    batch_prefix,
    collect,
    open_sink,
    parse_s3_uri,
)
from tests.fixtures.servers import boto_client


def _sink(endpoint: str, bucket: str, **kwargs: object) -> S3Sink:
    opts = ClientOptions(endpoint_url=endpoint, connect_timeout=2, read_timeout=2)
    kwargs.setdefault("base_delay", 0.01)
    kwargs.setdefault("max_delay", 0.05)
    kwargs.setdefault("rng", random.Random(0))
    return S3Sink(make_client("s3", opts), bucket, **kwargs)  # type: ignore[arg-type]


def _get(endpoint: str, bucket: str, key: str) -> bytes:
    return boto_client("s3", endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


def test_parse_s3_uri_splits_bucket_and_prefix() -> None:
    assert parse_s3_uri("s3://b/p/q/") == ("b", "p/q")
    assert parse_s3_uri("s3://b") == ("b", "")
    with pytest.raises(ValueError, match="s3://"):
        parse_s3_uri("file:///x")


def test_put_writes_once_and_second_put_is_a_duplicate(moto_server: str, s3_bucket: str) -> None:
    sink = _sink(moto_server, s3_bucket)

    async def go() -> tuple[bool, bool]:
        try:
            return await sink.put("p/b/k.json", b"first"), await sink.put("p/b/k.json", b"second")
        finally:
            await sink.close()

    assert asyncio.run(go()) == (True, False)
    assert _get(moto_server, s3_bucket, "p/b/k.json") == b"first"


def test_put_retries_through_a_run_of_503_and_500(moto_server: str, s3_bucket: str) -> None:
    with FaultProxy(moto_server, seed=1) as proxy:
        proxy.fail_next(3, status=503)
        proxy.fail_next(2, status=500)
        retried: list[str] = []
        sink = _sink(proxy.url, s3_bucket, on_retry=retried.append)

        async def go() -> bool:
            try:
                return await sink.put("retry/ok.json", b"body")
            finally:
                await sink.close()

        assert asyncio.run(go()) is True
        stats = proxy.stats
    assert stats["errors_503"] == 3
    assert stats["errors_500"] == 2
    assert sink.retries == 5 == len(retried)
    assert _get(moto_server, s3_bucket, "retry/ok.json") == b"body"


def test_put_retries_through_connection_resets(moto_server: str, s3_bucket: str) -> None:
    with FaultProxy(moto_server) as proxy:
        proxy.fail_next(2, status=0)
        sink = _sink(proxy.url, s3_bucket)
        assert asyncio.run(sink.put("reset.json", b"x")) is True
        assert proxy.stats["resets"] == 2
    assert _get(moto_server, s3_bucket, "reset.json") == b"x"


def test_put_retries_a_read_timeout_and_lands_exactly_once(
    moto_server: str, s3_bucket: str
) -> None:
    # Every request is slower than the client's read timeout until latency is lifted:
    # the first attempt may still reach S3 after the client gave up; a retry then
    # sees 412 and reports a duplicate, which still means "the result is there".
    with FaultProxy(moto_server, latency=1.5) as proxy:
        opts = ClientOptions(endpoint_url=proxy.url, connect_timeout=1, read_timeout=0.5)
        sink = S3Sink(make_client("s3", opts), s3_bucket, base_delay=0.3, max_delay=0.3)

        async def go() -> bool:
            task = asyncio.create_task(sink.put("slow.json", b"slow"))
            await asyncio.sleep(0.6)
            proxy.configure(latency=0.0)
            return await task

        outcome = asyncio.run(go())
        assert sink.retries >= 1
    assert outcome in (True, False)
    assert _get(moto_server, s3_bucket, "slow.json") == b"slow"


def test_put_gives_up_after_max_attempts(moto_server: str, s3_bucket: str) -> None:
    with FaultProxy(moto_server, error_rate=1.0) as proxy:
        sink = _sink(proxy.url, s3_bucket, max_attempts=3)
        with pytest.raises(S3WriteError, match="after 3 attempts"):
            asyncio.run(sink.put("never.json", b"x"))
        assert proxy.stats["requests"] == 3


def test_put_to_a_missing_bucket_fails_at_once(moto_server: str) -> None:
    sink = _sink(moto_server, "no-such-bucket-qworker")
    with pytest.raises(S3WriteError):
        asyncio.run(sink.put("k.json", b"x"))
    assert sink.retries == 0


def test_collect_yields_every_object_of_one_batch_only(moto_server: str, s3_bucket: str) -> None:
    settings = SimpleNamespace(s3_endpoint_url=moto_server, aws_region="us-east-1")
    uri = f"s3://{s3_bucket}/out"
    sink = open_sink(uri, settings)
    from qworker.schema import result_key

    async def fill() -> None:
        for i in range(25):
            await sink.put(result_key("out", "night-1", f"doc-{i}"), b'{"i": %d}' % i)
        await sink.put(result_key("out", "night-2", "other"), b'{"other": 1}')
        await sink.close()

    asyncio.run(fill())
    assert batch_prefix("out", "night-1") == "out/night-1/"
    bodies = list(collect(uri, "night-1", settings))
    assert sorted(bodies) == sorted(b'{"i": %d}' % i for i in range(25))


def test_awkward_custom_ids_become_distinct_retrievable_objects(
    moto_server: str, s3_bucket: str
) -> None:
    from qworker.schema import result_key

    ids = [
        "a/b",
        "../../etc/passwd",
        "..",
        "naïve café ☕",
        "x" * 1024,
        "x" * 1023 + "y",
        "a b?c#d",
    ]
    keys = [result_key("p", "b/../c", cid) for cid in ids]
    assert len(set(keys)) == len(ids)
    sink = _sink(moto_server, s3_bucket)

    async def go() -> list[bool]:
        try:
            return [await sink.put(k, cid.encode()) for k, cid in zip(keys, ids, strict=True)]
        finally:
            await sink.close()

    assert all(asyncio.run(go()))
    for key, cid in zip(keys, ids, strict=True):
        assert _get(moto_server, s3_bucket, key) == cid.encode()
        assert ".." not in key.split("/")
