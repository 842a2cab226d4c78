"""``qworker produce`` to Kafka carries every job the worker accepts (up to max_job_bytes)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("aiokafka")

from qworker.cli import main
from qworker.worker.sources.kafka import KafkaSource


def _job_of(size: int) -> str:
    job = {"custom_id": "big", "batch_id": "b1", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "hi"}]}, "metadata": {"pad": ""}}
    line = json.dumps(job, separators=(",", ":"))
    return line.replace('"pad":""', '"pad":"' + "x" * (size - len(line)) + '"')


@pytest.mark.parametrize("codec", [None, "lz4"])
def test_a_job_of_exactly_max_job_bytes_is_produced_and_read_back(
    kafka_broker: str, kafka_topic: Callable[..., str], tmp_path: Path, codec: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = kafka_topic(1)
    line = _job_of(1 << 20)  # the default max_job_bytes; aiokafka's own limit is 1 MiB too
    (tmp_path / "in.jsonl").write_text(line + "\n")
    if codec:
        monkeypatch.setenv("QWORKER_KAFKA_COMPRESSION", codec)
    # --completion-window none: the line is sent as it is (no deadline stamped on it)
    assert main(["produce", "-i", str(tmp_path / "in.jsonl"), "--to",
                 f"kafka://{kafka_broker}/{topic}", "--no-manifest",
                 "--completion-window", "none"]) == 0

    async def read() -> list[bytes]:
        source = KafkaSource(kafka_broker, topic, "g-big", session_timeout_ms=3000,
                             poll_timeout_ms=100)
        await source.start()
        got: list[bytes] = []
        deadline = time.monotonic() + 20
        try:
            while not got and time.monotonic() < deadline:
                got += [m.body for m in await source.receive(1, 0.5)]
        finally:
            await source.close()
        return got

    assert asyncio.run(read()) == [line.encode()]


def test_a_message_as_large_as_the_broker_delivered_can_be_dead_lettered(
    kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    """A 1 MiB message that is not JSON: the dead-letter producer must not refuse it (the
    worker retries a failed dead-letter send, so a refusal would stall the partition)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = kafka_topic(1)
    body = b"{" + b"x" * ((1 << 20) - 1)

    async def go() -> bytes:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_broker, enable_idempotence=False,
                                    compression_type="lz4", max_request_size=4 << 20)
        await producer.start()
        try:
            await producer.send_and_wait(topic, body)
        finally:
            await producer.stop()
        source = KafkaSource(kafka_broker, topic, "g-bigdlq", session_timeout_ms=3000,
                             poll_timeout_ms=100)
        await source.start()
        try:
            msgs = []
            deadline = time.monotonic() + 20
            while not msgs and time.monotonic() < deadline:
                msgs = await source.receive(1, 0.5)
            await source.dead_letter(msgs[0], "not valid JSON")
        finally:
            await source.close()
        reader = AIOKafkaConsumer(f"{topic}.dlq", bootstrap_servers=kafka_broker,
                                  auto_offset_reset="earliest")
        await reader.start()
        try:
            return (await asyncio.wait_for(reader.getone(), 15)).value
        finally:
            await reader.stop()

    assert asyncio.run(go()) == body
