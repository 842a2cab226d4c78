"""Every Kafka codec, produced by real client libraries, is read by the Kafka source.

aiokafka (each codec) and librdkafka through ``confluent-kafka`` (each codec) write into
one single-partition topic of the tansu broker, interleaved with gzip batches; the
source must hand out every message in offset order with its exact body. A batch the
consumer cannot decode stops the source with ``KafkaDecodeError`` instead of a silent
stall.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

pytest.importorskip("aiokafka")

from aiokafka import AIOKafkaProducer

from qworker.worker.sources.base import Message
from qworker.worker.sources.kafka import KafkaDecodeError, KafkaSource
from qworker.worker.sources.kafka_client import CODECS, check_codecs

SESSION_MS = 3000


async def _aiokafka_send(broker: str, topic: str, codec: str, bodies: list[bytes]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=broker, compression_type=codec, enable_idempotence=False, acks="all"
    )
    await producer.start()
    try:
        for body in bodies:
            await producer.send_and_wait(topic, body, key=body[:8])
    finally:
        await producer.stop()


def _librdkafka_send(broker: str, topic: str, codec: str, bodies: list[bytes]) -> None:
    confluent = pytest.importorskip("confluent_kafka")
    producer = confluent.Producer(
        {"bootstrap.servers": broker, "compression.codec": codec, "enable.idempotence": False,
         "linger.ms": 20, "acks": "all"}
    )
    errors: list[object] = []
    for body in bodies:
        producer.produce(topic, value=body, key=body[:8],
                         on_delivery=lambda err, _msg: errors.append(err) if err else None)
    assert producer.flush(15) == 0
    assert errors == []


def _body(tag: str, i: int) -> bytes:
    # Compressible and distinct: codecs that mangle or drop records show up.
    return (f'{{"custom_id": "{tag}-{i}", "pad": "' + "x" * 200 + '"}').encode()


async def _receive_all(source: KafkaSource, n: int, timeout: float = 20.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += await source.receive(n - len(got), 0.5)
    return got


def test_all_codecs_are_available() -> None:
    check_codecs()  # raises when cramjam is missing


def test_source_reads_every_codec_from_aiokafka_and_librdkafka_in_one_topic(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    topic = kafka_topic(1)
    expected: list[bytes] = []

    async def go() -> None:
        for codec in CODECS:
            # A gzip batch around each codec's batch: one bad codec would block them too.
            for tag, bodies in ((f"gz-{codec}", [_body(f"gz-{codec}", 0)]),
                                (f"aio-{codec}", [_body(f"aio-{codec}", i) for i in range(3)])):
                await _aiokafka_send(kafka_broker, topic, "gzip" if tag.startswith("gz") else codec,
                                     bodies)
                expected.extend(bodies)
            rd = [_body(f"rd-{codec}", i) for i in range(3)]
            await asyncio.to_thread(_librdkafka_send, kafka_broker, topic, codec, rd)
            expected.extend(rd)
        source = KafkaSource(kafka_broker, topic, "g-codecs", session_timeout_ms=SESSION_MS,
                             poll_timeout_ms=100)
        await source.start()
        try:
            got = await _receive_all(source, len(expected))
        finally:
            await source.close()
        assert [m.body for m in got] == expected
        offsets = [int(m.message_id.rsplit("/", 1)[1]) for m in got]
        assert offsets == sorted(offsets)

    asyncio.run(go())


def test_an_undecodable_batch_stops_the_source_with_a_clear_error(
    kafka_broker: str, kafka_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiokafka.codec

    topic = kafka_topic(1)

    async def go() -> None:
        source = KafkaSource(kafka_broker, topic, "g-undecodable", session_timeout_ms=SESSION_MS,
                             poll_timeout_ms=100)
        await source.start()
        try:
            # As if the zstd library were missing in this process.
            monkeypatch.setattr(aiokafka.codec, "cramjam", None)
            await _aiokafka_send(kafka_broker, topic, "gzip", [_body("before", 0)])
            first = await _receive_all(source, 1)
            assert [m.body for m in first] == [_body("before", 0)]
            monkeypatch.undo()
            await _aiokafka_send(kafka_broker, topic, "zstd", [_body("z", 0)])
            monkeypatch.setattr(aiokafka.codec, "cramjam", None)
            with pytest.raises(KafkaDecodeError, match="zstd"):
                await _receive_all(source, 1, timeout=10)
            # and it keeps saying so instead of pretending the topic is empty
            with pytest.raises(KafkaDecodeError):
                await source.receive(1, 0.1)
        finally:
            await source.close()

    asyncio.run(go())


def test_start_refuses_without_the_codec_library(
    kafka_broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiokafka.codec

    monkeypatch.setattr(aiokafka.codec, "cramjam", None)
    source = KafkaSource(kafka_broker, "never-created", "g-nocodec")
    with pytest.raises(ValueError, match=r"snappy, lz4, zstd .*aiokafka\[lz4,snappy,zstd\]"):
        asyncio.run(source.start())


def test_many_records_per_compressed_batch_with_headers_and_any_key_are_all_read(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    """Batching producers (librdkafka linger, aiokafka send without wait): one compressed
    batch holds dozens of records, with headers, null keys or keys unlike the custom_id."""
    confluent = pytest.importorskip("confluent_kafka")
    topic = kafka_topic(1)
    expected: list[bytes] = []
    for codec in CODECS:
        producer = confluent.Producer({"bootstrap.servers": kafka_broker,
                                       "compression.codec": codec, "linger.ms": 200,
                                       "batch.num.messages": 10000, "enable.idempotence": False})
        for i in range(40):
            body = _body(f"rdb-{codec}", i)
            producer.produce(topic, value=body, key=None if i % 2 else f"k{i}",
                             headers=[("trace", b"t"), ("empty", b"")] if i % 3 else None)
            expected.append(body)
        assert producer.flush(15) == 0

    async def go() -> None:
        for codec in CODECS:
            producer = AIOKafkaProducer(bootstrap_servers=kafka_broker, compression_type=codec,
                                        linger_ms=100, enable_idempotence=False)
            await producer.start()
            try:
                sent = []
                for i in range(40):
                    body = _body(f"aiob-{codec}", i)
                    sent.append(await producer.send(topic, body, key=None if i % 2 else b"x",
                                                    headers=[("h", b"v")] if i % 3 else None))
                    expected.append(body)
                await asyncio.gather(*sent)
            finally:
                await producer.stop()
        source = KafkaSource(kafka_broker, topic, "g-batched", session_timeout_ms=SESSION_MS,
                             poll_timeout_ms=100)
        await source.start()
        try:
            got = await _receive_all(source, len(expected), timeout=30)
        finally:
            await source.close()
        assert [m.body for m in got] == expected

    asyncio.run(go())
