"""How much work a Kafka consumer group has left: the lag behind every partition's end.

``group_lag`` compares the group's committed offsets with the end offsets of every
partition of the topic, the contract ``--until-idle`` relies on (docs/operations.md).
Some brokers answer ListOffsets(latest) per record batch rather than per record (the
tansu test broker reports 1 for a partition holding 20 records), which would make a
busy topic look drained; ``RecordProbe`` confirms a zero lag by fetching from the
committed offsets with a consumer of its own (no group): any record found there is
work left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

log = logging.getLogger(__name__)

_PROBE_WAIT_S = 1.0  # how long a probe fetch may take to find a record


async def stop_quietly(client: Any, timeout: float) -> None:
    """Stop an aiokafka client; never raises (a dead broker can make ``stop`` fail or hang).

    aiokafka may surface a ``CancelledError`` of its own fetch task from ``stop``; it is
    swallowed unless this task itself is being cancelled.
    """
    try:
        await asyncio.wait_for(client.stop(), timeout)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
    except Exception as exc:
        log.debug("kafka client stop failed: %r", exc)


async def group_lag(
    consumer: AIOKafkaConsumer, topic: str, timeout: float
) -> tuple[int, dict[TopicPartition, int]]:
    """(total lag, start offset per partition) of ``consumer``'s group on ``topic``.

    A partition's start is its committed offset, or its log start when the group never
    committed there. Raises (``KafkaError``, ``TimeoutError``, ``RuntimeError``) when
    the broker cannot be asked or the topic has no partitions.
    """
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        await asyncio.wait_for(consumer.topics(), timeout)
        parts = consumer.partitions_for_topic(topic)
    if not parts:
        raise RuntimeError(f"kafka topic {topic!r} has no partitions")
    tps = [TopicPartition(topic, p) for p in sorted(parts)]
    ends = await asyncio.wait_for(consumer.end_offsets(tps), timeout)
    starts: dict[TopicPartition, int] = {}
    never: list[TopicPartition] = []
    for tp in tps:
        committed = await asyncio.wait_for(consumer.committed(tp), timeout)
        if committed is None:
            never.append(tp)
        else:
            starts[tp] = committed
    if never:
        starts.update(await asyncio.wait_for(consumer.beginning_offsets(never), timeout))
    return sum(max(0, ends[tp] - starts[tp]) for tp in tps), starts


class RecordProbe:
    """Counts records at or past given offsets, with a group-less consumer of its own.

    Started on first use and kept until ``stop``. ``consumer_options`` are passed to
    ``AIOKafkaConsumer`` (connection and security settings).
    """

    def __init__(self, bootstrap: str, request_timeout: float, **consumer_options: Any) -> None:
        self.bootstrap = bootstrap
        self.request_timeout = request_timeout
        self._options = consumer_options
        self._consumer: AIOKafkaConsumer | None = None

    async def records_from(self, starts: dict[TopicPartition, int]) -> int:
        """Records found at or past ``starts`` within about a second (0 = none found)."""
        if not starts:
            return 0
        consumer = await self._started()
        consumer.assign(list(starts))
        for tp, offset in starts.items():
            consumer.seek(tp, offset)
        found = 0
        deadline = time.monotonic() + _PROBE_WAIT_S
        while not found and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            found = sum(
                1 for tp, recs in batches.items() for rec in recs if rec.offset >= starts[tp]
            )
        return found

    async def topics(self) -> set[str]:
        """Every topic the cluster has (a metadata request that never auto-creates one)."""
        consumer = await self._started()
        return set(await asyncio.wait_for(consumer.topics(), self.request_timeout))

    async def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` has (0 when the cluster does not know it)."""
        consumer = await self._started()
        return len(consumer.partitions_for_topic(topic) or ())

    async def stop(self) -> None:
        """Stop the probe consumer if it was started; never raises."""
        if self._consumer is not None:
            await stop_quietly(self._consumer, self.request_timeout)
            self._consumer = None

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                group_id=None,
                enable_auto_commit=False,
                fetch_max_wait_ms=100,
                request_timeout_ms=int(self.request_timeout * 1000),
                **self._options,
            )
            try:
                await asyncio.wait_for(consumer.start(), self.request_timeout)
            except BaseException:
                await stop_quietly(consumer, self.request_timeout)  # no "Unclosed" at exit
                raise
            self._consumer = consumer
        return self._consumer
