"""The Kafka source against a real (tansu) broker: commits, restarts, backpressure, rebalances."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("aiokafka")

from aiokafka import AIOKafkaConsumer, TopicPartition

from qworker.worker.sources.base import Message
from qworker.worker.sources.kafka import (
    DLQ_REASON_HEADER,
    KafkaSource,
    KafkaURI,
    produce,
)

SESSION_MS = 3000


def _source(broker: str, topic: str, group: str, **kwargs: Any) -> KafkaSource:
    kwargs.setdefault("session_timeout_ms", SESSION_MS)
    kwargs.setdefault("commit_interval", 0.2)
    kwargs.setdefault("poll_timeout_ms", 100)
    return KafkaSource(broker, topic, group, **kwargs)


async def _produce(broker: str, topic: str, n: int, start: int = 0) -> None:
    items = [(f"job-{i}", b'{"i": %d}' % i) for i in range(start, start + n)]
    assert await produce(f"kafka://{broker}/{topic}", items, None) == n


async def _receive_n(source: KafkaSource, n: int, timeout: float = 15.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += await source.receive(n - len(got), 0.5)
    return got


async def _committed(broker: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    consumer = AIOKafkaConsumer(bootstrap_servers=broker, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return {p: await consumer.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        await consumer.stop()


def _offset(msg: Message) -> int:
    return int(msg.message_id.rsplit("/", 1)[1])


def test_uri_parses_brokers_topic_and_group() -> None:
    parsed = KafkaURI.parse("kafka://a:1,b:2/jobs?group=g1")
    assert (parsed.bootstrap, parsed.topic, parsed.group) == ("a:1,b:2", "jobs", "g1")
    assert KafkaURI.parse("kafka://a:1/jobs").group == "qworker"
    with pytest.raises(ValueError, match="topic"):
        KafkaURI.parse("kafka://a:1/")


def test_commit_stops_at_the_lowest_unfinished_offset_and_restart_resumes_there(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)

    async def go() -> None:
        await _produce(kafka_broker, topic, 10)
        source = _source(kafka_broker, topic, "g-restart")
        await source.start()
        msgs = await _receive_n(source, 10)
        assert [_offset(m) for m in msgs] == list(range(10))
        assert msgs[0].key == "job-0"
        assert msgs[0].message_id == f"{topic}/0/0"
        for m in msgs:
            if _offset(m) in (0, 1, 3, 4):
                await source.ack(m)
        await source.commit()
        assert (await _committed(kafka_broker, "g-restart", topic, 1))[0] == 2
        await source.close()  # 2 and 5..9 are unfinished: nothing past 2 is committed
        assert (await _committed(kafka_broker, "g-restart", topic, 1))[0] == 2

        again = _source(kafka_broker, topic, "g-restart")
        await again.start()
        redelivered = await _receive_n(again, 8)
        assert [_offset(m) for m in redelivered] == list(range(2, 10))
        for m in redelivered:
            await again.ack(m)
        await again.close()
        assert (await _committed(kafka_broker, "g-restart", topic, 1))[0] == 10

    asyncio.run(go())


def test_full_buffer_pauses_fetching_and_resumes_when_drained(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)

    async def go() -> None:
        await _produce(kafka_broker, topic, 30)
        source = _source(kafka_broker, topic, "g-pause", buffer_size=4)
        await source.start()
        deadline = time.monotonic() + 15
        while not source.paused and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert source.paused
        assert len(source._buffer) <= 4
        msgs = await _receive_n(source, 30)
        assert sorted(_offset(m) for m in msgs) == list(range(30))
        assert source.pauses >= 2
        for m in msgs:
            await source.ack(m)
        await source.close()
        assert (await _committed(kafka_broker, "g-pause", topic, 1))[0] == 30

    asyncio.run(go())


def test_a_job_held_longer_than_max_poll_interval_keeps_the_partition(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)

    async def go() -> None:
        await _produce(kafka_broker, topic, 1)
        source = _source(kafka_broker, topic, "g-long", max_poll_interval_ms=1000)
        revoked: list[Message] = []
        source.on_revoke = revoked.extend
        await source.start()
        [msg] = await _receive_n(source, 1)
        await asyncio.sleep(2.5)  # the "job" runs 2.5x max_poll_interval
        await source.ack(msg)
        await source.commit()
        assert revoked == []
        assert (await _committed(kafka_broker, "g-long", topic, 1))[0] == 1
        await source.close()

    asyncio.run(go())


def test_dead_letter_goes_to_the_dlq_topic_with_a_reason_and_counts_as_done(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)

    async def go() -> None:
        await produce(f"kafka://{kafka_broker}/{topic}", [("bad", b"not json")], None)
        source = _source(kafka_broker, topic, "g-dlq")
        await source.start()
        [msg] = await _receive_n(source, 1)
        await source.dead_letter(msg, "not a JSON object")
        await source.close()
        assert (await _committed(kafka_broker, "g-dlq", topic, 1))[0] == 1

        reader = AIOKafkaConsumer(
            f"{topic}.dlq", bootstrap_servers=kafka_broker, auto_offset_reset="earliest"
        )
        await reader.start()
        try:
            record = await asyncio.wait_for(reader.getone(), 15)
        finally:
            await reader.stop()
        assert record.value == b"not json"
        assert record.key == b"bad"
        headers = dict(record.headers)
        assert headers[DLQ_REASON_HEADER] == b"not a JSON object"
        # Where it came from, so readers can drop the repeats of an at-least-once DLQ.
        assert headers["qworker-source-topic"] == topic.encode()
        assert headers["qworker-source-partition"] == b"0"
        assert headers["qworker-source-offset"] == b"0"

    asyncio.run(go())


def test_two_consumers_in_one_group_lose_nothing_across_a_rebalance(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(4)
    group = "g-rebalance"
    total = 60

    async def worker(source: KafkaSource, done: set[str], stop: asyncio.Event) -> None:
        """Ack each message after a short 'job', unless it was revoked meanwhile."""
        revoked: set[str] = set()
        source.on_revoke = lambda msgs: revoked.update(m.message_id for m in msgs)
        while not stop.is_set():
            for m in await source.receive(5, 0.2):
                await asyncio.sleep(0.01)
                if m.message_id not in revoked:
                    await source.ack(m)
                    done.add(m.message_id)

    async def go() -> None:
        await _produce(kafka_broker, topic, total // 2)
        done_a: set[str] = set()
        done_b: set[str] = set()
        stop = asyncio.Event()
        a = _source(kafka_broker, topic, group)
        await a.start()
        task_a = asyncio.create_task(worker(a, done_a, stop))
        deadline = time.monotonic() + 15
        while not done_a and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        b = _source(kafka_broker, topic, group)
        await b.start()  # joining triggers a rebalance while A has work in flight
        task_b = asyncio.create_task(worker(b, done_b, stop))
        await _produce(kafka_broker, topic, total - total // 2, start=total // 2)
        deadline = time.monotonic() + 30
        while len(done_a | done_b) < total and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(task_a, task_b)
        await a.close()
        await b.close()
        assert len(done_a | done_b) == total
        assert done_b, "the second consumer never got a partition"
        committed = await _committed(kafka_broker, group, topic, 4)
        assert sum(v or 0 for v in committed.values()) == total

    asyncio.run(go())


def test_uncommitted_count_falls_to_zero_once_finished_work_is_committed(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)

    async def go() -> None:
        await _produce(kafka_broker, topic, 5)
        source = _source(kafka_broker, topic, "g-count", commit_interval=60)
        await source.start()
        msgs = await _receive_n(source, 5)
        assert source.uncommitted_count() == 5
        for m in msgs[:3]:
            await source.ack(m)
        await source.commit()
        assert source.uncommitted_count() == 2
        for m in msgs[3:]:
            await source.ack(m)
        await source.commit()
        assert source.uncommitted_count() == 0
        await source.close()

    asyncio.run(go())


def test_abandoned_message_is_handed_out_again_and_holds_the_commit_back(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)

    async def go() -> None:
        await _produce(kafka_broker, topic, 3)
        source = _source(kafka_broker, topic, "g-abandon")
        await source.start()
        msgs = await _receive_n(source, 3)
        await source.abandon(msgs[1])
        await source.ack(msgs[0])
        await source.ack(msgs[2])
        await source.commit()
        assert (await _committed(kafka_broker, "g-abandon", topic, 1))[0] == 1
        [again] = await _receive_n(source, 1)
        assert again.message_id == msgs[1].message_id
        await source.ack(again)
        await source.close()
        assert (await _committed(kafka_broker, "g-abandon", topic, 1))[0] == 3

    asyncio.run(go())


def test_start_returns_with_the_waiting_backlog_ready_for_the_first_receive(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(2)

    async def go() -> None:
        await _produce(kafka_broker, topic, 6)
        source = _source(kafka_broker, topic, "g-backlog")
        await source.start()
        first = await source.receive(10, 0.0)  # no waiting at all
        assert first, "start returned before the waiting records were fetched"
        for m in first + await _receive_n(source, 6 - len(first)):
            await source.ack(m)
        await source.close()

    asyncio.run(go())
