"""Producing to Kafka: the source's dead-letter producer and bulk ``produce``.

Producers use neither idempotence nor transactions (the tansu test broker lacks
them) and wait for ``acks="all"``. Connection options (TLS, SASL) come from one
``KafkaSecurity`` (``kafka_client``), the same as the consumer's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    BrokerResponseError,
    ClusterAuthorizationFailedError,
    TopicAuthorizationFailedError,
)

from qworker.worker.failures import Refused
from qworker.worker.sources.base import Message
from qworker.worker.sources.kafka_client import KafkaSecurity, check_connection
from qworker.worker.sources.kafka_lag import stop_quietly
from qworker.worker.sources.kafka_rebalance import KafkaHandle

#: Room for a record's key, headers and batch framing beyond its body.
_RECORD_HEADROOM = 64 << 10
#: The dead-letter producer's client-side size check: far above any broker's limit, so
#: what the broker delivered is never refused here (the broker's own limit still applies).
_DLQ_MAX_REQUEST_BYTES = 64 << 20
DLQ_REASON_HEADER = "qworker-dlq-reason"
DLQ_SOURCE_HEADER = "qworker-source"
#: Where a dead letter came from, so readers can drop the repeats an at-least-once
#: dead-letter path produces (docs/formats.md): topic, partition and offset.
DLQ_TOPIC_HEADER = "qworker-source-topic"
DLQ_PARTITION_HEADER = "qworker-source-partition"
DLQ_OFFSET_HEADER = "qworker-source-offset"


def refuses_record(exc: BaseException) -> bool:
    """True for a broker's (or the client's) refusal of this one record for good.

    A non-retriable broker answer about the record (too large, invalid for the topic,
    a schema the topic enforces): not an outage. Authorization failures are not about
    one record (a configuration problem); timeouts and connection errors are transient.
    """
    return (isinstance(exc, BrokerResponseError) and not exc.retriable
            and not isinstance(exc, TopicAuthorizationFailedError
                               | ClusterAuthorizationFailedError))


class DeadLetterProducer:
    """Sends dead-lettered messages to one DLQ topic; the producer starts on first use.

    The source checks at start that the DLQ topic exists or creates it. A record the
    broker refuses for good raises ``Refused`` (``refuses_record``).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        request_timeout: float,
        security: KafkaSecurity | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.request_timeout = request_timeout
        self.security = security or KafkaSecurity()
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()

    async def send(self, msg: Message, reason: str) -> None:
        """Produce ``msg``'s raw body and key with reason / source headers; raises on failure."""
        producer = await self._started()
        headers = [
            (DLQ_REASON_HEADER, reason.encode("utf-8", "replace")),
            (DLQ_SOURCE_HEADER, msg.message_id.encode()),
        ]
        handle = msg.handle
        if isinstance(handle, KafkaHandle):
            headers += [
                (DLQ_TOPIC_HEADER, handle.tp.topic.encode()),
                (DLQ_PARTITION_HEADER, str(handle.tp.partition).encode()),
                (DLQ_OFFSET_HEADER, str(handle.offset).encode()),
            ]
        key = msg.key.encode() if msg.key is not None else None
        try:
            await asyncio.wait_for(
                producer.send_and_wait(self.topic, msg.body, key=key, headers=headers),
                self.request_timeout,
            )
        except Exception as exc:
            if refuses_record(exc):
                raise Refused(f"kafka topic {self.topic} refused the record: {exc!r}") from exc
            raise

    async def stop(self) -> None:
        """Stop the producer if it was started; never raises."""
        if self._producer is not None:
            await stop_quietly(self._producer, self.request_timeout)

    async def _started(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap,
                    enable_idempotence=False,
                    acks="all",
                    request_timeout_ms=int(self.request_timeout * 1000),
                    max_request_size=_DLQ_MAX_REQUEST_BYTES,
                    **self.security.client_options(),
                )
                try:
                    await asyncio.wait_for(producer.start(), self.request_timeout)
                except BaseException:
                    await stop_quietly(producer, self.request_timeout)
                    raise
                self._producer = producer
            return self._producer


async def produce_to(
    bootstrap: str,
    topic: str,
    items: Iterable[tuple[str | None, bytes]],
    security: KafkaSecurity | None = None,
    compression: str | None = None,
    max_job_bytes: int = 1 << 20,
) -> int:
    """Send every ``(key, body)`` to ``topic``; return the count once all are acknowledged.

    ``compression`` is a Kafka codec (gzip, snappy, lz4, zstd) or None. A body of
    ``max_job_bytes`` (what the worker accepts) always fits the client's request limit;
    the broker's own limit (``message.max.bytes``) applies to the compressed batch.
    """
    security = security or KafkaSecurity()
    # Refused credentials or an untrusted broker: one AuthError line (exit 1), not
    # aiokafka's "Unable to bootstrap".
    await check_connection(bootstrap, security, 30.0)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        enable_idempotence=False,
        acks="all",
        linger_ms=5,
        compression_type=compression,
        max_request_size=max(1 << 20, max_job_bytes) + _RECORD_HEADROOM,
        **security.client_options(),
    )
    count = 0
    try:
        await producer.start()  # inside the try: a failed start is stopped too (no "Unclosed")
        pending: list[asyncio.Future[Any]] = []
        for key, body in items:
            pending.append(await producer.send(topic, body, key=key.encode() if key else None))
            count += 1
            if len(pending) >= 1000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return count
