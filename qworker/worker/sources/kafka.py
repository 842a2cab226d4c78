"""Kafka job source: an aiokafka consumer group with manual watermark commits.

Delivery (docs/formats.md, "Delivery guarantees"): at-least-once. Offsets are
committed by hand, per partition, at the *watermark* (``qworker.worker.offsets``): the
lowest offset whose result is not yet in the sink. Commits happen every
``commit_interval`` seconds, before partitions are revoked, and on ``close``; never
past unfinished work.

How the pieces fit:

- A poll task calls ``getmany`` in a loop, so aiokafka's ``max_poll_interval_ms``
  never expires however long a job runs; fetched records wait in a local buffer
  until ``receive`` hands them out. When the buffer holds ``buffer_size`` records
  the task pauses every assigned partition and resumes them once it drained
  (backpressure without leaving the group).
- Rebalances (aiokafka uses the eager protocol: every rebalance revokes every
  partition, then assigns the new set): on revoke, finished work is committed and
  the revoked partitions stop handing out messages, but their state is parked;
  on assign, partitions that came back resume as if nothing happened (their
  in-flight jobs keep running, re-fetched offsets are recognised and skipped);
  partitions that moved elsewhere are dropped and their in-flight messages go to
  ``on_revoke`` so the worker aborts them. Later acks for them are ignored; the
  new owner re-runs them and the sink's first-write-wins makes that harmless.
- ``dead_letter`` produces the raw message to ``<topic>.dlq`` (or the configured
  topic) with ``qworker-dlq-reason`` / ``qworker-source`` headers, then acks it.
  The producer uses neither idempotence nor transactions (the tansu test broker
  lacks them). ``start`` checks that the DLQ topic exists and creates it when it does
  not (as many partitions as the job topic, the broker's default replication); one
  that can be neither is a configuration error (exit 1). A record the DLQ topic
  refuses for good raises ``Refused`` (the worker writes it to the sink instead).

- Every codec (gzip, snappy, lz4, zstd) is read; a batch that still cannot be decoded
  (an unknown codec, a corrupt batch) is never skipped: ``receive`` raises
  ``KafkaDecodeError`` from then on, and the worker stops (exit 69, docs/formats.md).

Partition bookkeeping lives in ``kafka_rebalance``, producing in ``kafka_produce``,
connection options (TLS, SASL, codecs) in ``kafka_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import (
    ConsumerStoppedError,
    CorruptRecordException,
    KafkaError,
    UnsupportedCodecError,
)
from aiokafka.structs import OffsetAndMetadata

from qworker.worker.failures import SourceUnavailableError, StartupError
from qworker.worker.sources.base import Message, Source
from qworker.worker.sources.kafka_client import KafkaSecurity, check_codecs, check_connection
from qworker.worker.sources.kafka_lag import RecordProbe, group_lag, stop_quietly
from qworker.worker.sources.kafka_produce import (
    DLQ_REASON_HEADER,
    DLQ_SOURCE_HEADER,
    DeadLetterProducer,
    produce_to,
)
from qworker.worker.sources.kafka_rebalance import (
    KafkaHandle,
    PartitionBook,
    PartitionState,
    RebalanceListener,
)

__all__ = [
    "DEFAULT_GROUP",
    "DLQ_REASON_HEADER",
    "DLQ_SOURCE_HEADER",
    "KafkaDecodeError",
    "KafkaHandle",
    "KafkaSecurity",
    "KafkaSource",
    "KafkaURI",
    "open_source",
    "produce",
]

log = logging.getLogger(__name__)

DEFAULT_GROUP = "qworker"


class KafkaDecodeError(SourceUnavailableError):
    """A fetched batch cannot be decoded (unknown codec, corrupt batch): not retryable.

    ``fatal`` tells the worker to stop rather than retry (exit 69, docs/operations.md).
    """

    fatal = True


@dataclass(slots=True)
class KafkaURI:
    """A parsed ``kafka://host:port[,host:port]/topic?group=NAME``."""

    bootstrap: str
    topic: str
    group: str

    @classmethod
    def parse(cls, uri: str) -> KafkaURI:
        """Parse ``uri``; ``ValueError`` naming the missing part if it is malformed."""
        parts = urllib.parse.urlsplit(uri)
        if parts.scheme != "kafka":
            raise ValueError(f"source {uri!r} must start with kafka://")
        topic = parts.path.strip("/")
        if not parts.netloc or not topic:
            raise ValueError(f"source {uri!r} must be kafka://host:port[,host:port]/topic")
        group = urllib.parse.parse_qs(parts.query).get("group", [DEFAULT_GROUP])[0]
        return cls(bootstrap=parts.netloc, topic=topic, group=group)


class KafkaSource(Source):
    """Consumes one topic as member of a consumer group; see the module docstring.

    All methods run on the event loop that called ``start``. ``buffer_size`` bounds
    the records fetched but not yet received; ``session_timeout_ms`` is the group
    session (heartbeats every quarter of it). ``start`` returns once the group is
    joined and records already waiting for this member are buffered (at most
    ``start_wait`` seconds), so the first ``receive`` sees the backlog.
    """

    kind = "kafka"

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        group: str = DEFAULT_GROUP,
        *,
        session_timeout_ms: int = 10000,
        commit_interval: float = 5.0,
        dlq_topic: str | None = None,
        buffer_size: int = 256,
        poll_timeout_ms: int = 200,
        request_timeout: float = 30.0,
        max_poll_interval_ms: int = 300000,
        start_wait: float = 10.0,
        security: KafkaSecurity | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.group = group
        self.session_timeout_ms = session_timeout_ms
        self.commit_interval = commit_interval
        self.dlq_topic = dlq_topic or f"{topic}.dlq"
        self.buffer_size = max(1, buffer_size)
        self.poll_timeout_ms = poll_timeout_ms
        self.request_timeout = request_timeout
        self.max_poll_interval_ms = max_poll_interval_ms
        self.start_wait = start_wait
        self.security = security or KafkaSecurity()
        self.on_revoke = None
        #: Times the poll task paused partitions for backpressure (for tests/metrics).
        self.pauses = 0
        self._consumer: AIOKafkaConsumer | None = None
        self._dlq = DeadLetterProducer(bootstrap, self.dlq_topic, request_timeout, self.security)
        self._probe = RecordProbe(bootstrap, request_timeout, **self.security.client_options())
        self._fatal: KafkaDecodeError | None = None
        #: Seconds between the metadata requests that tell an outage from an idle topic.
        self.liveness_interval = 2.0
        self.liveness_timeout = 10.0
        self._down: BaseException | None = None
        self._commit_lock = asyncio.Lock()
        self._book = PartitionBook()
        self._buffer: deque[Message] = deque()
        self._ready = asyncio.Event()
        self._paused = False
        self._closed = False
        self._tasks: list[asyncio.Task[None]] = []
        self._checked = False

    # -- lifecycle -------------------------------------------------------------------

    async def check(self) -> None:
        """Before the model loads: the brokers accept us, the topic and the DLQ topic exist.

        Raises ``AuthError`` (refused SASL credentials, an unverified certificate),
        ``StartupError`` when the topic does not exist (no auto-creation here) or the DLQ
        topic can be neither found nor created, ``SourceUnavailableError`` when no broker
        answers. Joins no group.
        """
        check_codecs()
        await check_connection(self.bootstrap, self.security, self.request_timeout)
        topics = await self._probe.topics()
        if self.topic not in topics:
            raise StartupError(f"kafka topic {self.topic!r} does not exist on {self.bootstrap}")
        if self.dlq_topic not in topics:
            await self._create_dlq_topic()
        self._checked = True

    async def start(self) -> None:
        """``check`` (unless done), join the group, start the poll, commit and probe tasks."""
        if self._consumer is not None:  # an earlier start failed half-way
            await stop_quietly(self._consumer, self.request_timeout)
            self._consumer = None
        if not self._checked:
            await self.check()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group,
            client_id=f"qworker-{self.group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=max(100, self.session_timeout_ms // 4),
            request_timeout_ms=int(self.request_timeout * 1000),
            max_poll_records=self.buffer_size,
            max_poll_interval_ms=self.max_poll_interval_ms,
            **self.security.client_options(),
        )
        listener = RebalanceListener(self._on_revoked, self._on_assigned)
        self._consumer.subscribe([self.topic], listener=listener)
        await self._consumer.start()
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="kafka-poll"),
            asyncio.create_task(self._commit_loop(), name="kafka-commit"),
            asyncio.create_task(self._liveness_loop(), name="kafka-liveness"),
        ]
        await self._await_backlog(self.start_wait)
        log.info("kafka source started topic=%s group=%s", self.topic, self.group)

    async def _create_dlq_topic(self) -> None:
        """Create the missing DLQ topic; ``StartupError`` when the broker refuses."""
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic
        from aiokafka.errors import TopicAlreadyExistsError, for_code

        partitions = max(1, await self._probe.partition_count(self.topic))
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap,
                                    request_timeout_ms=int(self.request_timeout * 1000),
                                    **self.security.client_options())
        try:
            await asyncio.wait_for(admin.start(), self.request_timeout)
            cluster = await asyncio.wait_for(admin.describe_cluster(), self.request_timeout)
            replicas = max(1, min(3, len(cluster.get("brokers") or [])))
            response = await asyncio.wait_for(
                admin.create_topics([NewTopic(self.dlq_topic, partitions, replicas)]),
                self.request_timeout)
        finally:
            with contextlib.suppress(Exception):  # closed on every path: no "Unclosed"
                await asyncio.wait_for(admin.close(), self.request_timeout)
        for error in getattr(response, "topic_errors", []):
            code = error[1]
            if code and for_code(code) is not TopicAlreadyExistsError:
                message = error[2] if len(error) > 2 else ""
                raise StartupError(
                    f"kafka dead-letter topic {self.dlq_topic!r} does not exist on "
                    f"{self.bootstrap} and cannot be created: {for_code(code).__name__} "
                    f"{message or ''}".strip())
        log.info("kafka dead-letter topic %s created (%d partitions, %d replicas)",
                 self.dlq_topic, partitions, replicas)

    async def _await_backlog(self, timeout: float) -> None:
        # Return from start only once records already waiting are in the buffer, so a
        # caller's first receive sees the backlog (``--until-idle`` must not mistake the
        # first fetch round trip for an empty topic).
        consumer = self._consumer
        assert consumer is not None
        assigned = sorted(consumer.assignment())
        if not assigned:
            return
        deadline = time.monotonic() + timeout
        try:
            ends = await asyncio.wait_for(consumer.end_offsets(assigned), timeout)
            positions = [await consumer.position(tp) for tp in assigned]
        except (KafkaError, TimeoutError) as exc:
            log.debug("kafka backlog check skipped: %r", exc)
            return
        if all(pos >= ends[tp] for tp, pos in zip(assigned, positions, strict=True)):
            return
        while not self._buffer and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Commit finished work, leave the group, stop the DLQ producer; idempotent.

        Messages still in flight stay uncommitted: the group redelivers them.
        """
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._consumer is not None:
            await self.commit()
            coordinator = getattr(self._consumer, "_coordinator", None)
            if getattr(coordinator, "generation", None) == 0:
                # tansu numbers the first generation 0 and aiokafka only sends LeaveGroup
                # from generation > 0; without it the group waits a full session timeout
                # before handing our partitions on. LeaveGroup itself carries no generation.
                coordinator.generation = 1  # type: ignore[union-attr]
            await stop_quietly(self._consumer, self.request_timeout)
        await self._dlq.stop()
        await self._probe.stop()
        self._ready.set()
        log.info("kafka source closed topic=%s group=%s", self.topic, self.group)

    # -- the Source interface --------------------------------------------------------

    async def receive(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` fetched messages; ``[]`` after ``timeout`` seconds.

        Raises ``KafkaDecodeError`` once a batch could not be decoded (see the module),
        ``SourceUnavailableError`` while no broker answers (aiokafka itself only logs
        that and returns nothing): the worker rides the latter out within its budget.
        """
        if self._fatal is not None and not self._buffer:
            raise self._fatal
        if self._closed:
            return []
        if self._down is not None and not self._buffer:
            raise SourceUnavailableError(f"kafka brokers unreachable: {self._down!r}")
        deadline = time.monotonic() + timeout
        while not self._buffer and not self._closed:
            if self._fatal is not None:
                raise self._fatal
            self._ready.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(self._ready.wait(), remaining)
            except TimeoutError:
                return []
        out: list[Message] = []
        while self._buffer and len(out) < max_messages:
            msg = self._buffer.popleft()
            handle: KafkaHandle = msg.handle
            part = self._book.owned.get(handle.tp)
            if part is None or part.epoch != handle.epoch:
                continue
            part.inflight[handle.offset] = msg
            out.append(msg)
        return out

    async def ack(self, msg: Message) -> None:
        """Mark ``msg`` finished; the watermark (and the next commit) may advance past it."""
        part = self._owner(msg)
        if part is None:
            log.debug("ack ignored for revoked message_id=%s", msg.message_id)
            return
        handle: KafkaHandle = msg.handle
        part.inflight.pop(handle.offset, None)
        part.watermark.finish(handle.offset)

    async def abandon(self, msg: Message) -> None:
        """Put ``msg`` back, unfinished: handed out again later, never committed until acked."""
        part = self._owner(msg)
        if part is None:
            return
        handle: KafkaHandle = msg.handle
        if part.inflight.pop(handle.offset, None) is None or self._closed:
            return
        if handle.tp in self._book.parked:
            part.parked.append(msg)  # handed out again if the partition comes back
        else:
            self._buffer.appendleft(msg)
            self._ready.set()

    async def dead_letter(self, msg: Message, reason: str) -> None:
        """Produce ``msg`` to the DLQ topic with reason headers, then ack it.

        Raises (and does not ack) when the DLQ produce fails.
        """
        await self._dlq.send(msg, reason)  # raises Refused for a record refused for good
        log.warning("dead-lettered message_id=%s to %s: %s", msg.message_id, self.dlq_topic, reason)
        await self.ack(msg)

    async def pending_work(self) -> int:
        """The group's lag over every partition of the topic, after committing ours.

        Lag is end offset minus committed offset (the log start when nothing was
        committed). Some brokers report end offsets per record batch rather than per
        record (the tansu test broker does), so a zero lag is confirmed by fetching
        from the committed offsets: any record found there is pending work. Raises
        when the broker cannot be asked.
        """
        consumer = self._consumer
        if consumer is None:
            raise RuntimeError("kafka source not started")
        await self.commit()
        lag, starts = await group_lag(consumer, self.topic, self.request_timeout)
        if lag == 0:
            lag = await self._probe.records_from(starts)
        return max(lag, len(self._buffer))

    def position(self, msg: Message) -> dict[str, Any]:
        """Topic, partition and offset of ``msg``."""
        handle: KafkaHandle = msg.handle
        return {"topic": handle.tp.topic, "partition": handle.tp.partition,
                "offset": handle.offset}

    # -- introspection ---------------------------------------------------------------

    @property
    def uncommitted_offsets(self) -> int:
        """Offsets fetched past the last commit, over all owned partitions."""
        return sum(p.watermark.uncommitted for p in self._book.owned.values())

    def uncommitted_count(self) -> int:
        """``qworker_uncommitted_offsets``: offsets fetched past the last commit."""
        return self.uncommitted_offsets

    @property
    def paused(self) -> bool:
        """True while fetching is paused because the local buffer is full."""
        return self._paused

    def watermarks(self) -> dict[int, int | None]:
        """Partition number -> current watermark of the owned partitions."""
        return {tp.partition: p.watermark.watermark for tp, p in self._book.owned.items()}

    # -- commits ---------------------------------------------------------------------

    async def commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit the watermark of owned partitions (or ``only`` these) that advanced.

        Failures (a rebalance in progress, a lost membership) are logged, not raised:
        the next commit or the next owner takes over from the last good commit.
        """
        if self._consumer is None:
            return
        async with self._commit_lock:
            wanted = set(only) if only is not None else set(self._book.owned)
            offsets: dict[TopicPartition, OffsetAndMetadata] = {}
            for tp in wanted:
                part = self._book.owned.get(tp)
                if part is not None and part.watermark.needs_commit():
                    mark = part.watermark.watermark
                    assert mark is not None
                    offsets[tp] = OffsetAndMetadata(mark, "")
            if not offsets:
                return
            try:
                await asyncio.wait_for(self._consumer.commit(offsets), self.request_timeout)
            except (KafkaError, TimeoutError) as exc:
                log.warning("kafka commit failed (will retry): %r", exc)
                return
            for tp, om in offsets.items():
                part = self._book.owned.get(tp)
                if part is not None:
                    part.watermark.mark_committed(om.offset)
            log.debug("kafka committed %s", {tp.partition: om.offset for tp, om in offsets.items()})

    async def _liveness_loop(self) -> None:
        # aiokafka retries a lost broker silently (getmany just returns nothing): ask the
        # cluster for its metadata now and then so an outage is seen, not taken for idle.
        consumer = self._consumer
        assert consumer is not None
        while True:
            await asyncio.sleep(self.liveness_interval)
            try:
                await asyncio.wait_for(consumer.topics(), self.liveness_timeout)
            except (KafkaError, TimeoutError) as exc:
                if self._down is None:
                    log.warning("kafka brokers do not answer: %r", exc)
                self._down = exc
                self._ready.set()
            else:
                if self._down is not None:
                    log.warning("kafka brokers answer again")
                self._down = None

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.commit_interval)
            await self.commit()

    # -- polling ---------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        while not self._closed:
            self._apply_backpressure()
            room = max(1, self.buffer_size - len(self._buffer))
            try:
                batches = await consumer.getmany(timeout_ms=self.poll_timeout_ms, max_records=room)
            except ConsumerStoppedError:
                return
            except (UnsupportedCodecError, CorruptRecordException) as exc:
                # Retrying refetches the same batch forever: stop and say why instead.
                self._fatal = KafkaDecodeError(
                    f"cannot decode a Kafka batch of {self.topic}: {exc}"
                )
                log.error("%s; stopping the poll (nothing after it is read)", self._fatal)
                self._ready.set()
                return
            except KafkaError as exc:
                log.warning("kafka poll failed: %r", exc)
                await asyncio.sleep(0.5)
                continue
            for tp, records in batches.items():
                self._take(tp, records)
            if self._buffer:
                self._ready.set()

    def _take(self, tp: TopicPartition, records: list[Any]) -> None:
        part = self._book.owned.get(tp)
        if part is None:
            return  # revoked while the fetch was in flight
        now = time.time()
        for rec in records:
            try:
                fresh = part.watermark.track(rec.offset)
            except ValueError:
                log.warning(
                    "skipping out-of-order offset %s/%d/%d", tp.topic, tp.partition, rec.offset
                )
                continue
            if not fresh:
                continue  # a re-fetch of work we already hold (after a rebalance)
            key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
            self._buffer.append(
                Message(
                    body=rec.value if rec.value is not None else b"",
                    message_id=f"{tp.topic}/{tp.partition}/{rec.offset}",
                    key=key,
                    handle=KafkaHandle(tp, rec.offset, part.epoch),
                    received_at=now,
                )
            )

    def _apply_backpressure(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        owned = [tp for tp in self._book.owned if tp in consumer.assignment()]
        if len(self._buffer) >= self.buffer_size:
            if not self._paused:
                self._paused = True
                self.pauses += 1
                log.debug("kafka buffer full (%d): pausing fetch", len(self._buffer))
            consumer.pause(*owned)
        elif self._paused:
            self._paused = False
            consumer.resume(*owned)

    # -- rebalances ------------------------------------------------------------------

    def _owner(self, msg: Message) -> PartitionState | None:
        return self._book.owner(msg.handle)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        if self._closed:
            return
        await self.commit(only=revoked)
        self._buffer = self._book.park(revoked, self._buffer)
        log.info("kafka partitions revoked: %s", sorted(tp.partition for tp in revoked))

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        lost = await self._book.assign(assigned, self._still_ours, self._buffer)
        if self._paused:
            self._paused = False
            consumer.resume(*assigned)
        if self._buffer:
            self._ready.set()
        log.info("kafka partitions assigned: %s", sorted(tp.partition for tp in assigned))
        if lost:
            log.warning("kafka rebalance moved %d in-flight jobs elsewhere; aborting", len(lost))
            if self.on_revoke is not None:
                self.on_revoke(lost)

    async def _still_ours(self, tp: TopicPartition, part: PartitionState) -> bool:
        # If someone else committed past our last commit while we were out of the group
        # (a lapsed session), our parked state is stale: start fresh from their commit.
        assert self._consumer is not None
        try:
            committed = await asyncio.wait_for(self._consumer.committed(tp), self.request_timeout)
        except (KafkaError, TimeoutError):
            return False
        mine = part.watermark.committed
        if mine is None:
            mine = part.watermark.first  # never committed: we started from their offset
        return committed is None or (mine is not None and committed <= mine)


def open_source(uri: str, settings: Any) -> KafkaSource:
    """Build (not start) the Kafka source for ``uri`` from ``WorkerSettings``."""
    parsed = KafkaURI.parse(uri)
    return KafkaSource(
        parsed.bootstrap,
        parsed.topic,
        parsed.group,
        session_timeout_ms=getattr(settings, "kafka_session_timeout_ms", 10000),
        commit_interval=getattr(settings, "kafka_commit_interval_seconds", 5.0),
        dlq_topic=getattr(settings, "kafka_dlq_topic", None),
        buffer_size=min(256, getattr(settings, "max_inflight_jobs", 256)),
        security=KafkaSecurity.from_settings(settings),
    )


async def produce(uri: str, items: Iterable[tuple[str | None, bytes]], settings: Any) -> int:
    """Send every ``(key, body)`` to the topic of ``uri`` (key = custom_id); return the count.

    Waits for every send to be acknowledged by the broker (``acks="all"``); TLS/SASL from
    the settings, compression from ``settings.kafka_compression`` when it has one.
    """
    parsed = KafkaURI.parse(uri)
    return await produce_to(
        parsed.bootstrap,
        parsed.topic,
        items,
        KafkaSecurity.from_settings(settings),
        getattr(settings, "kafka_compression", None),
        getattr(settings, "max_job_bytes", 1 << 20),
    )
