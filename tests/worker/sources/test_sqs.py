"""The SQS source against a real moto server: receive, ack, abandon, heartbeats, DLQ."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("boto3")

from qworker.testing.faultproxy import FaultProxy
from qworker.worker.aws import ClientOptions, make_client
from qworker.worker.sources.base import Message
from qworker.worker.sources.sqs import (
    DLQ_REASON_ATTRIBUTE,
    SqsSource,
    open_source,
    parse_sqs_uri,
    produce,
)
from tests.fixtures.servers import QueueInfo, boto_client


def _settings(endpoint: str, **kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(sqs_endpoint_url=endpoint, aws_region="us-east-1", **kwargs)


def _source(endpoint: str, queue: str, **kwargs: Any) -> SqsSource:
    client = make_client("sqs", ClientOptions(endpoint_url=endpoint, read_timeout=30))
    return SqsSource(client, queue, **kwargs)


async def _fill(endpoint: str, queue: str, n: int) -> None:
    items = [(f"job-{i}", b'{"i": %d}' % i) for i in range(n)]
    assert await produce(f"sqs://{queue}", items, _settings(endpoint)) == n


async def _receive_n(source: SqsSource, n: int, timeout: float = 10.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += await source.receive(n - len(got), 1)
    return got


def _counts(endpoint: str, url: str) -> tuple[int, int]:
    attrs = boto_client("sqs", endpoint).get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return (
        int(attrs["ApproximateNumberOfMessages"]),
        int(attrs["ApproximateNumberOfMessagesNotVisible"]),
    )


def test_uri_accepts_a_queue_url_or_name() -> None:
    assert parse_sqs_uri("sqs://jobs") == "jobs"
    assert parse_sqs_uri("sqs://http://127.0.0.1:5000/123/jobs") == "http://127.0.0.1:5000/123/jobs"
    with pytest.raises(ValueError, match="sqs://"):
        parse_sqs_uri("sqs://")


def test_received_messages_are_deleted_only_on_ack(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue()

    async def go() -> None:
        await _fill(moto_server, queue.url, 12)
        source = open_source(f"sqs://{queue.name}", _settings(moto_server))
        await source.start()
        msgs = await _receive_n(source, 12)
        assert len(msgs) == 12
        assert sorted(m.key or "" for m in msgs) == sorted(f"job-{i}" for i in range(12))
        assert _counts(moto_server, queue.url) == (0, 12)
        for m in msgs[:5]:
            await source.ack(m)
        assert _counts(moto_server, queue.url) == (0, 7)
        for m in msgs[5:]:
            await source.ack(m)
        assert _counts(moto_server, queue.url) == (0, 0)
        await source.close()

    asyncio.run(go())


def test_abandoned_message_is_visible_again_at_once(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue(visibility=60)

    async def go() -> None:
        await _fill(moto_server, queue.url, 1)
        first = _source(moto_server, queue.url)
        second = _source(moto_server, queue.url)
        await first.start()
        await second.start()
        [msg] = await _receive_n(first, 1)
        await first.abandon(msg)
        [again] = await _receive_n(second, 1, timeout=3)
        assert again.message_id == msg.message_id
        assert again.handle.receive_count == 2
        await second.ack(again)
        await first.close()
        await second.close()

    asyncio.run(go())


def test_heartbeats_keep_a_long_job_invisible_to_other_workers(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue()

    async def go() -> None:
        await _fill(moto_server, queue.url, 1)
        worker = _source(moto_server, queue.url, visibility_timeout=2, heartbeat_interval=0.4)
        other = _source(moto_server, queue.url, visibility_timeout=2)
        await worker.start()
        await other.start()
        [msg] = await _receive_n(worker, 1)
        # The "job" runs twice the visibility timeout; the other worker keeps polling.
        stolen = await _receive_n(other, 1, timeout=3.0)
        assert stolen == []
        assert worker.heartbeats >= 3
        await worker.ack(msg)
        await worker.close()
        await other.close()
        assert _counts(moto_server, queue.url) == (0, 0)

    asyncio.run(go())


def test_held_messages_stay_invisible_over_several_visibility_periods_on_a_slow_server(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    """60 held messages (6 heartbeat batches), every SQS call 0.5 s, visibility 3 s.

    Regression: batches renewed one after another (3 s a round here) and rounds timed
    from the previous one's end let half of them expire and go to other workers.
    """
    queue = sqs_queue()
    peek = boto_client("sqs", moto_server)

    async def go() -> None:
        await _fill(moto_server, queue.url, 60)
        with FaultProxy(moto_server, latency=0.5) as slow:
            client = make_client("sqs", ClientOptions(endpoint_url=slow.url, read_timeout=30))
            worker = SqsSource(client, queue.url, visibility_timeout=3)  # rounds every 1 s
            await worker.start()
            try:
                msgs = await _receive_n(worker, 60, timeout=30)
                assert len(msgs) == 60
                held_until = time.monotonic() + 8  # well over two visibility timeouts
                while time.monotonic() < held_until:
                    seen = await asyncio.to_thread(
                        peek.receive_message, QueueUrl=queue.url, MaxNumberOfMessages=10,
                        VisibilityTimeout=0, WaitTimeSeconds=0,
                    )
                    assert seen.get("Messages", []) == []
                    assert _counts(moto_server, queue.url) == (0, 60)
                    await asyncio.sleep(0.5)
                assert worker.heartbeats >= 60 * 5
                for msg in msgs[:25]:
                    await worker.abandon(msg)  # batched by the releaser, flushed by close
            finally:
                await worker.close()
        assert _counts(moto_server, queue.url) == (60, 0)

    asyncio.run(go())


def test_close_makes_unfinished_messages_visible_again(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue(visibility=60)

    async def go() -> None:
        await _fill(moto_server, queue.url, 3)
        source = _source(moto_server, queue.url)
        await source.start()
        msgs = await _receive_n(source, 3)
        await source.ack(msgs[0])
        await source.close()
        assert _counts(moto_server, queue.url) == (2, 0)

    asyncio.run(go())


def test_dead_letter_uses_the_redrive_queue_and_deletes_the_original(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue(dlq=True)

    async def go() -> None:
        await produce(f"sqs://{queue.url}", [("bad", b"not json")], _settings(moto_server))
        source = _source(moto_server, queue.url)
        await source.start()
        assert source.dlq_url == queue.dlq_url
        [msg] = await _receive_n(source, 1)
        await source.dead_letter(msg, "not a JSON object")
        await source.close()

    asyncio.run(go())
    assert _counts(moto_server, queue.url) == (0, 0)
    assert queue.dlq_url is not None
    dead = boto_client("sqs", moto_server).receive_message(
        QueueUrl=queue.dlq_url, MessageAttributeNames=["All"], WaitTimeSeconds=1
    )["Messages"]
    assert [m["Body"] for m in dead] == ["not json"]
    reason = dead[0]["MessageAttributes"][DLQ_REASON_ATTRIBUTE]["StringValue"]
    assert reason == "not a JSON object"


def test_configured_dlq_url_wins_over_the_redrive_policy(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue(dlq=True)
    target = sqs_queue()

    async def go() -> None:
        source = open_source(f"sqs://{queue.url}", _settings(moto_server, sqs_dlq_url=target.url))
        await source.start()
        assert source.dlq_url == target.url
        await source.close()

    asyncio.run(go())


def test_a_long_poll_that_returns_after_close_gives_its_messages_back(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue(visibility=60)

    async def go() -> None:
        source = _source(moto_server, queue.url, long_poll_seconds=5)
        await source.start()
        assert await source.receive(10, 0.2) == []  # leaves a long poll outstanding
        await source.close()
        await _fill(moto_server, queue.url, 1)  # the orphaned poll receives this one
        other = _source(moto_server, queue.url)
        await other.start()
        got = await _receive_n(other, 1, timeout=5)
        assert len(got) == 1, "the message stayed invisible after the poll's owner closed"
        await other.ack(got[0])
        await other.close()

    asyncio.run(go())


def test_start_returns_with_waiting_messages_ready_for_the_first_receive(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue()

    async def go() -> None:
        await _fill(moto_server, queue.url, 3)
        source = _source(moto_server, queue.url)
        await source.start()
        first = await source.receive(10, 0.0)
        assert first, "start returned before the waiting messages were received"
        for m in first + await _receive_n(source, 3 - len(first)):
            await source.ack(m)
        await source.close()

    asyncio.run(go())


def test_many_concurrent_acks_all_delete_in_batches(
    moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    # One deleter sends DeleteMessageBatch calls one at a time: fewer calls, and no two
    # deletes race (moto rewrites a queue's message list in DeleteMessage without a lock,
    # so racing deletes can be lost there).
    queue = sqs_queue(visibility=300)

    async def go() -> None:
        await _fill(moto_server, queue.url, 40)
        source = _source(moto_server, queue.url)
        await source.start()
        msgs = await _receive_n(source, 40)
        assert len(msgs) == 40
        await asyncio.gather(*(source.ack(m) for m in msgs))
        assert 4 <= source.delete_calls < 40
        await source.close()

    asyncio.run(go())
    assert _counts(moto_server, queue.url) == (0, 0)
