"""The S3 sink against a real moto server, directly and through the fault proxy."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("boto3")

from qworker.testing.faultproxy import FaultProxy
from qworker.worker.aws import ClientOptions, make_client
from qworker.worker.failures import StartupError
from qworker.worker.sinks.base import PutResult
from qworker.worker.sinks.s3 import (
    S3Sink,
    S3WriteError,
    batch_prefix,
    collect,
    open_sink,
    parse_s3_uri,
)
from tests.fixtures.servers import boto_client


def _sink(endpoint: str, bucket: str) -> S3Sink:
    opts = ClientOptions(endpoint_url=endpoint, connect_timeout=2, read_timeout=2)
    return S3Sink(make_client("s3", opts), bucket)


def _get(endpoint: str, bucket: str, key: str) -> bytes:
    return boto_client("s3", endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


def test_parse_s3_uri_splits_bucket_and_prefix() -> None:
    assert parse_s3_uri("s3://b/p/q/") == ("b", "p/q")
    assert parse_s3_uri("s3://b") == ("b", "")
    with pytest.raises(ValueError, match="s3://"):
        parse_s3_uri("file:///x")


def test_put_writes_once_and_a_second_put_reports_the_stored_fingerprint(
    moto_server: str, s3_bucket: str
) -> None:
    sink = _sink(moto_server, s3_bucket)

    async def go() -> list[PutResult]:
        try:
            return [await sink.put("p/b/k.json", b"first", "fp-1"),
                    await sink.put("p/b/k.json", b"second", "fp-2"),
                    await sink.put("p/b/old.json", b"legacy"),
                    await sink.put("p/b/old.json", b"again", "fp-3")]
        finally:
            await sink.close()

    assert asyncio.run(go()) == [PutResult(True), PutResult(False, "fp-1"), PutResult(True),
                                 PutResult(False, None)]
    assert _get(moto_server, s3_bucket, "p/b/k.json") == b"first"
    head = boto_client("s3", moto_server).head_object(Bucket=s3_bucket, Key="p/b/k.json")
    assert head["Metadata"] == {"qworker-fingerprint": "fp-1"}


def test_one_put_is_one_attempt_and_a_503_raises_a_transient_error(
    moto_server: str, s3_bucket: str
) -> None:
    with FaultProxy(moto_server, seed=1) as proxy:
        proxy.fail_next(1, status=503)
        sink = _sink(proxy.url, s3_bucket)
        with pytest.raises(S3WriteError) as info:
            asyncio.run(sink.put("once.json", b"x"))
        assert info.value.transient and proxy.stats["requests"] == 1


def test_put_to_a_missing_bucket_is_a_permanent_error_and_check_says_so(
    moto_server: str,
) -> None:
    sink = _sink(moto_server, "no-such-bucket-qworker")
    with pytest.raises(S3WriteError) as info:
        asyncio.run(sink.put("k.json", b"x"))
    assert not info.value.transient
    with pytest.raises(StartupError, match="no-such-bucket-qworker"):
        asyncio.run(sink.check())


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
            return [(await sink.put(k, cid.encode())).written
                    for k, cid in zip(keys, ids, strict=True)]
        finally:
            await sink.close()

    assert all(asyncio.run(go()))
    for key, cid in zip(keys, ids, strict=True):
        assert _get(moto_server, s3_bucket, key) == cid.encode()
        assert ".." not in key.split("/")
