"""SQS job source: long polling, visibility heartbeats, delete only after the result is written.

Delivery (docs/formats.md, "Delivery guarantees"): at-least-once. A received message
stays invisible for ``visibility_timeout`` seconds; a heartbeat task extends the visibility of every
message still in flight every third of that, so a long job is never handed to a
second worker. Heartbeat rounds run on a fixed cadence timed from their start and
send their ChangeMessageVisibilityBatch calls (10 messages each) concurrently, so
a slow server delays a round by one call's latency, not by one per 10 messages.
``ack`` deletes the message (its result is in the sink; one background deleter
batches acks into DeleteMessageBatch calls of up to 10); ``abandon`` sets its
visibility to 0 so another worker (or this one) takes it at once (one background
releaser batches those too); ``close`` releases whatever is still in flight, in
concurrent batches.

``dead_letter`` sends the raw body to the dead-letter queue (``sqs_dlq_url``, else
the target of the queue's RedrivePolicy) with a ``qworker_dlq_reason`` message
attribute, then deletes the original. ``start`` checks that a configured DLQ exists
(a missing one is a configuration error, exit 1). Without any DLQ,
``has_dead_letter_target`` is False and the worker writes dead letters to its sink
(docs/formats.md, "Dead letters"). A DLQ that refuses one message for good (too large
for its ``MaximumMessageSize``, characters SQS does not take) raises ``Refused``.

Every boto3 call runs on a private thread pool (``qworker.worker.aws``) with a
timeout. Receiving is a background long poll (up to ``long_poll_seconds``) that
outlives a short ``receive`` call: its messages wait in a small local buffer (at
most 10, heartbeated like any in-flight message). The poll runs on a daemon
thread so an idle poll never delays process exit; a poll that completes after
``close`` gives its messages back at once (visibility 0) from that thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from qworker.worker.aws import BlockingRunner, auth_error, make_client, sqs_options
from qworker.worker.failures import Refused, SourceUnavailableError, StartupError
from qworker.worker.outage import Backoff, Outage
from qworker.worker.retry import GaveUp, Retrier
from qworker.worker.sources.base import Message, Source

log = logging.getLogger(__name__)

DLQ_REASON_ATTRIBUTE = "qworker_dlq_reason"
DLQ_SOURCE_ATTRIBUTE = "qworker_source"
KEY_ATTRIBUTE = "custom_id"
MAX_WAIT_SECONDS = 20  # SQS's longest long poll
MAX_BATCH = 10  # SQS's most messages per receive / batch call
#: What ``pending_work`` adds up: work is left while any of these is above 0.
PENDING_ATTRIBUTES = [
    "ApproximateNumberOfMessages",
    "ApproximateNumberOfMessagesNotVisible",
    "ApproximateNumberOfMessagesDelayed",
]
_CALL_THREADS = 8  # concurrent SQS calls (heartbeat batches, deletes, releases)
#: SendMessage errors that refuse one message for good (not an outage of the DLQ).
_REFUSED_CODES = frozenset({"InvalidParameterValue", "InvalidMessageContents",
                            "MessageTooLong", "InvalidAttributeValue",
                            "AWS.SimpleQueueService.InvalidMessageContents"})


@dataclass(slots=True)
class SqsHandle:
    """``Message.handle`` of an SQS message: the receipt handle of this delivery."""

    receipt_handle: str
    receive_count: int


def parse_sqs_uri(uri: str) -> str:
    """``sqs://QUEUE_URL_OR_NAME`` -> the queue URL (``http(s)://...``) or the queue name."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "sqs" or not sep or not rest.strip("/"):
        raise ValueError(f"source {uri!r} must be sqs://QUEUE_URL_OR_NAME")
    if rest.startswith(("http://", "https://")):
        return rest
    if rest.startswith(("http/", "https/")):  # tolerate sqs://https/host/... from shells
        proto, _, tail = rest.partition("/")
        return f"{proto}://{tail}"
    return rest.strip("/")


class SqsSource(Source):
    """Consumes one SQS queue; see the module docstring.

    ``queue`` is a queue URL or name (resolved at ``start``). ``client`` is a boto3 SQS
    client whose read timeout exceeds ``MAX_WAIT_SECONDS``.
    """

    kind = "sqs"

    def __init__(
        self,
        client: Any,
        queue: str,
        *,
        visibility_timeout: int = 300,
        dlq_url: str | None = None,
        heartbeat_interval: float | None = None,
        call_timeout: float = 45.0,
        long_poll_seconds: int = MAX_WAIT_SECONDS,
        start_wait: float = 5.0,
    ) -> None:
        self.client = client
        self.queue = queue
        self.queue_url = queue if queue.startswith(("http://", "https://")) else ""
        self.visibility_timeout = max(1, visibility_timeout)
        self.dlq_url = dlq_url
        self.heartbeat_interval = heartbeat_interval or max(1.0, self.visibility_timeout / 3)
        self.call_timeout = call_timeout
        self.long_poll_seconds = min(MAX_WAIT_SECONDS, max(0, long_poll_seconds))
        self.start_wait = start_wait
        self.on_revoke = None
        #: Visibility extensions sent so far (for tests and metrics).
        self.heartbeats = 0
        #: DeleteMessageBatch calls made so far (acks are batched up to 10 a call).
        self.delete_calls = 0
        self._fifo = queue.endswith(".fifo")
        # Keyed by receipt handle: a message redelivered to us (an expired visibility)
        # is a second, separate delivery with its own handle.
        self._inflight: dict[str, Message] = {}
        self._buffer: deque[Message] = deque()
        self._ready = asyncio.Event()
        self._arrival_lock = threading.Lock()
        self._arrived: list[dict[str, Any]] = []
        self._poll: concurrent.futures.Future[Any] | None = None
        self._poll_failed = False
        self._poll_error: BaseException | None = None  # of the last completed poll
        self._poll_backoff_until = 0.0
        self._runner = BlockingRunner(_CALL_THREADS, "qworker-sqs")
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._deleter: asyncio.Task[None] | None = None
        self._deletes: deque[tuple[Message, asyncio.Future[None]]] = deque()
        self._delete_wakeup = asyncio.Event()
        self._delete_busy = False
        self._releases: list[Message] = []
        self._release_wakeup = asyncio.Event()
        self._releaser: asyncio.Task[None] | None = None
        self._release_busy = False
        #: Heartbeat rounds that took longer than a third of the visibility timeout.
        self.slow_heartbeats = 0
        self._closed = False
        self._closing = False  # close() began: pending deletes get one more try only
        self._checked = False

    async def _call(self, method: str, **kwargs: Any) -> Any:
        return await self._runner.run(self.call_timeout, getattr(self.client, method), **kwargs)

    async def check(self) -> None:
        """Before the model loads: resolve the queue URL and the dead-letter queue.

        Raises ``StartupError`` for a missing queue or DLQ, ``AuthError`` when AWS refuses
        the credentials or the policy does not allow the calls; receives nothing.
        """
        attrs = await self._queue_attributes(["RedrivePolicy"])
        if self.dlq_url is None:
            self.dlq_url = await self._redrive_target(attrs.get("RedrivePolicy"))
        else:
            await self._check_dlq(self.dlq_url)
        if self.dlq_url is None:
            log.warning("sqs queue %s has no dead-letter queue (no RedrivePolicy, no "
                        "sqs_dlq_url): messages that cannot be jobs go to the sink's "
                        "_dead_letters/", self.queue_url)
        self._checked = True

    async def _queue_attributes(self, names: list[str]) -> dict[str, str]:
        try:
            if not self.queue_url:
                found = await self._call("get_queue_url", QueueName=self.queue)
                self.queue_url = found["QueueUrl"]
            return dict((await self._call("get_queue_attributes", QueueUrl=self.queue_url,
                                          AttributeNames=names)).get("Attributes", {}))
        except Exception as exc:
            if _is_missing_queue(exc):
                raise StartupError(f"sqs queue {self.queue!r} does not exist") from None
            refused = auth_error(exc, f"sqs queue {self.queue!r}")
            if refused is not None:
                raise refused from None
            raise

    async def start(self) -> None:
        """``check`` (unless done), then start the heartbeat task.

        When the queue already holds messages, returns once the first poll delivered
        some (at most ``start_wait`` s), so the caller's first ``receive`` sees them.
        """
        if not self._checked:
            await self.check()
        attrs = await self._queue_attributes(["ApproximateNumberOfMessages"])
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="sqs-heartbeat")
        self._deleter = asyncio.create_task(self._delete_loop(), name="sqs-delete")
        self._releaser = asyncio.create_task(self._release_loop(), name="sqs-release")
        if int(attrs.get("ApproximateNumberOfMessages", "0")) > 0:
            self._ensure_poll(MAX_BATCH)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), self.start_wait)
        log.info("sqs source started queue=%s dlq=%s", self.queue_url, self.dlq_url)

    async def _redrive_target(self, policy: str | None) -> str | None:
        import json

        if not policy:
            return None
        arn = json.loads(policy).get("deadLetterTargetArn", "")
        parts = arn.split(":")
        if len(parts) < 6:
            return None
        try:
            found = await self._call(
                "get_queue_url", QueueName=parts[5], QueueOwnerAWSAccountId=parts[4]
            )
        except Exception as exc:
            if _is_missing_queue(exc):
                raise StartupError(f"the redrive dead-letter queue {arn} of sqs queue "
                                   f"{self.queue!r} does not exist") from None
            refused = auth_error(exc, f"sqs dead-letter queue {arn}")
            if refused is not None:
                raise refused from None
            raise
        return str(found["QueueUrl"])

    async def _check_dlq(self, url: str) -> None:
        """A configured dead-letter queue must exist (``StartupError`` otherwise)."""
        try:
            await self._call("get_queue_attributes", QueueUrl=url,
                             AttributeNames=["MaximumMessageSize"])
        except Exception as exc:
            if _is_missing_queue(exc):
                raise StartupError(f"sqs dead-letter queue {url!r} (sqs_dlq_url) does not "
                                   "exist") from None
            refused = auth_error(exc, f"sqs dead-letter queue {url!r}")
            if refused is not None:
                raise refused from None
            raise

    @property
    def has_dead_letter_target(self) -> bool:
        """True when a DLQ (``sqs_dlq_url`` or the redrive target) was found at start."""
        return self.dlq_url is not None

    def position(self, msg: Message) -> dict[str, Any]:
        """The queue, the message id and how often SQS delivered it."""
        handle: SqsHandle = msg.handle
        return {"queue": self.queue_url, "message_id": msg.message_id,
                "receive_count": handle.receive_count}

    async def receive(self, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` received messages; ``[]`` after ``timeout`` seconds.

        A background long poll (``long_poll_seconds``, at most 10 messages) keeps
        running across calls, so a short ``timeout`` never turns into short polling.
        Raises ``SourceUnavailableError`` while the last poll failed (SQS unreachable):
        the worker rides that out within its outage budget.
        """
        deadline = time.monotonic() + timeout
        while not self._closed:
            self._take_arrived()
            if self._buffer:
                out = []
                while self._buffer and len(out) < max_messages:
                    out.append(self._buffer.popleft())
                return out
            if self._poll_error is not None:
                self._ensure_poll(max_messages)  # the next try (after a short backoff)
                raise SourceUnavailableError(
                    f"sqs receive failed: {self._poll_error}") from self._poll_error
            self._ensure_poll(max_messages)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), min(remaining, 1.0))
        return []

    def _ensure_poll(self, max_messages: int) -> None:
        if self._poll is not None or time.monotonic() < self._poll_backoff_until:
            return
        loop = asyncio.get_running_loop()
        wanted = min(MAX_BATCH, max(1, max_messages))
        poll: concurrent.futures.Future[Any] = concurrent.futures.Future()
        poll.add_done_callback(lambda fut: self._poll_finished(fut, loop))
        self._poll = poll
        # A daemon thread, not the pool: an idle 20 s poll must not hold up process exit.
        threading.Thread(
            target=self._poll_once, args=(wanted, poll), name="qworker-sqs-poll", daemon=True
        ).start()

    def _poll_once(self, wanted: int, poll: concurrent.futures.Future[Any]) -> None:
        # Runs on the poll thread.
        try:
            poll.set_result(self._receive_raw(wanted))
        except Exception as exc:
            poll.set_exception(exc)

    def _receive_raw(self, wanted: int) -> list[dict[str, Any]]:
        resp = self.client.receive_message(
            QueueUrl=self.queue_url,
            MaxNumberOfMessages=wanted,
            WaitTimeSeconds=self.long_poll_seconds,
            VisibilityTimeout=self.visibility_timeout,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
            MessageAttributeNames=["All"],
        )
        return list(resp.get("Messages", []))

    def _poll_finished(self, fut: concurrent.futures.Future[Any], loop: Any) -> None:
        # Runs on the poll thread. After close nobody will take the messages: give them
        # back right here (visibility 0) instead of letting them sit invisible.
        with self._arrival_lock:
            try:
                raws = fut.result()
                error: BaseException | None = None
            except Exception as exc:
                log.warning("sqs receive failed: %r", exc)
                raws, error = [], exc
            if self._closed:
                self._release_sync(raws)
                return
            self._arrived.extend(raws)
            self._poll_failed = error is not None
            self._poll_error = error
        with contextlib.suppress(RuntimeError):  # the loop is gone: close() handles it
            loop.call_soon_threadsafe(self._on_poll_done)

    def _on_poll_done(self) -> None:
        self._poll = None
        if self._poll_failed:
            self._poll_backoff_until = time.monotonic() + 1.0
        self._take_arrived()
        self._ready.set()

    def _take_arrived(self) -> None:
        with self._arrival_lock:
            raws, self._arrived = self._arrived, []
        now = time.time()
        for raw in raws:
            attrs = raw.get("MessageAttributes") or {}
            key = attrs.get(KEY_ATTRIBUTE, {}).get("StringValue")
            count = int((raw.get("Attributes") or {}).get("ApproximateReceiveCount", "1"))
            msg = Message(
                body=raw.get("Body", "").encode("utf-8"),
                message_id=raw["MessageId"],
                key=key,
                handle=SqsHandle(raw["ReceiptHandle"], count),
                received_at=now,
            )
            self._inflight[msg.handle.receipt_handle] = msg
            self._buffer.append(msg)

    def _release_sync(self, raws: list[dict[str, Any]]) -> None:
        for i in range(0, len(raws), MAX_BATCH):
            entries = [
                {"Id": str(n), "ReceiptHandle": r["ReceiptHandle"], "VisibilityTimeout": 0}
                for n, r in enumerate(raws[i : i + MAX_BATCH])
            ]
            try:
                self.client.change_message_visibility_batch(
                    QueueUrl=self.queue_url, Entries=entries
                )
            except Exception as exc:
                log.warning("sqs release after close failed: %r", exc)

    async def ack(self, msg: Message) -> None:
        """Delete ``msg`` (its result is in the sink); returns once SQS answered.

        Deletes are batched (DeleteMessageBatch, up to 10) by one background task:
        fewer calls under load, and never two delete calls racing on one queue. A
        stale receipt is logged, not raised.
        """
        self._inflight.pop(msg.handle.receipt_handle, None)
        if self._deleter is None or self._deleter.done():
            await self._delete_with_retries([msg])
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deletes.append((msg, done))
        self._delete_wakeup.set()
        await done

    async def _delete_loop(self) -> None:
        while True:
            await self._delete_wakeup.wait()
            self._delete_wakeup.clear()
            while self._deletes:
                batch = [self._deletes.popleft() for _ in range(min(MAX_BATCH, len(self._deletes)))]
                self._delete_busy = True
                try:
                    await self._delete_with_retries([m for m, _ in batch])
                finally:
                    self._delete_busy = False
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)

    async def _delete_with_retries(self, msgs: list[Message]) -> None:
        # A failed call is retried (SQS briefly unreachable): an undeleted message would
        # come back after its visibility timeout and be served again for nothing. Past
        # that timeout its receipt is stale anyway; at close, one more try is enough.
        retrier = Retrier(Outage("sqs delete", float(self.visibility_timeout)),
                          Backoff(first=0.2, cap=5.0), stop=lambda: self._closing)
        try:
            await retrier.call(lambda: self._delete_batch(msgs), "sqs delete")
        except GaveUp:
            log.warning("sqs delete of %d messages given up: they come back after their "
                        "visibility timeout and are absorbed as duplicates", len(msgs))

    async def _delete_batch(self, msgs: list[Message]) -> None:
        """One DeleteMessageBatch call; raises when the call itself failed."""
        entries = [
            {"Id": str(n), "ReceiptHandle": m.handle.receipt_handle} for n, m in enumerate(msgs)
        ]
        self.delete_calls += 1
        try:
            resp = await self._call(
                "delete_message_batch", QueueUrl=self.queue_url, Entries=entries
            )
        except Exception as exc:
            log.warning("sqs delete of %d messages failed: %r", len(msgs), exc)
            raise
        for failed in resp.get("Failed", []):
            # Expired receipt: another worker owns it now and will hit the sink's 412.
            log.warning(
                "sqs delete refused message_id=%s: %s",
                msgs[int(failed["Id"])].message_id,
                failed.get("Message"),
            )

    async def abandon(self, msg: Message) -> None:
        """Make ``msg`` visible again (visibility 0): redelivered, never deleted.

        Returns at once: a background releaser batches abandons into
        ChangeMessageVisibilityBatch calls, and ``close`` flushes what is left.
        A failed release only delays redelivery until the visibility timeout.
        """
        self._inflight.pop(msg.handle.receipt_handle, None)
        if self._releaser is None or self._releaser.done():
            await self._release([msg])
            return
        self._releases.append(msg)
        self._release_wakeup.set()

    async def _release_loop(self) -> None:
        while True:
            await self._release_wakeup.wait()
            self._release_wakeup.clear()
            while self._releases:
                msgs, self._releases = self._releases, []
                self._release_busy = True
                try:
                    await self._release(msgs)
                finally:
                    self._release_busy = False

    async def _release(self, msgs: list[Message]) -> None:
        """Visibility 0 for ``msgs``: concurrent batch calls of up to 10."""
        await self._change_visibility(msgs, 0, "release")

    async def _change_visibility(self, msgs: list[Message], timeout: int, what: str) -> int:
        """ChangeMessageVisibilityBatch over ``msgs``, all batches at once; count changed."""
        chunks = [msgs[i : i + MAX_BATCH] for i in range(0, len(msgs), MAX_BATCH)]
        results = await asyncio.gather(
            *(self._change_chunk(chunk, timeout, what) for chunk in chunks)
        )
        return sum(results)

    async def _change_chunk(self, chunk: list[Message], timeout: int, what: str) -> int:
        entries = [
            {"Id": str(n), "ReceiptHandle": m.handle.receipt_handle, "VisibilityTimeout": timeout}
            for n, m in enumerate(chunk)
        ]
        try:
            resp = await self._call(
                "change_message_visibility_batch", QueueUrl=self.queue_url, Entries=entries
            )
        except Exception as exc:
            log.warning("sqs %s of %d messages failed: %r", what, len(chunk), exc)
            return 0
        failed = resp.get("Failed", [])
        for entry in failed:
            log.warning(
                "sqs %s refused message_id=%s: %s",
                what,
                chunk[int(entry["Id"])].message_id,
                entry.get("Message"),
            )
        return len(entries) - len(failed)

    async def dead_letter(self, msg: Message, reason: str) -> None:
        """Send ``msg`` to the DLQ with ``reason`` as an attribute, then delete it.

        Raises (and keeps the message) when the DLQ send fails: ``Refused`` when SQS
        refuses this message for good, or when there is no DLQ at all.
        """
        if self.dlq_url is None:
            raise Refused("the sqs queue has no dead-letter queue")
        extra: dict[str, Any] = {}
        if self.dlq_url.endswith(".fifo"):
            extra = {"MessageGroupId": "dlq", "MessageDeduplicationId": msg.message_id}
        try:
            await self._call(
                "send_message",
                QueueUrl=self.dlq_url,
                MessageBody=msg.body.decode("utf-8", "replace"),
                MessageAttributes={
                    DLQ_REASON_ATTRIBUTE: {"DataType": "String",
                                           "StringValue": (reason or "-")[:1024]},
                    DLQ_SOURCE_ATTRIBUTE: {"DataType": "String", "StringValue": msg.message_id},
                },
                **extra,
            )
        except Exception as exc:
            if _error_code(exc) in _REFUSED_CODES:
                raise Refused(f"sqs dead-letter queue refused the message: {exc}") from exc
            raise
        log.warning(
            "dead-lettered message_id=%s to %s: %s", msg.message_id, self.dlq_url, reason
        )
        await self.ack(msg)

    async def close(self) -> None:
        """Stop heartbeats and make every message still in flight visible again; idempotent."""
        if self._closed:
            return
        self._closing = True
        poll = self._poll
        if poll is not None and not poll.done():
            # On a busy queue the poll returns within milliseconds: wait a moment so its
            # messages are released below rather than by the poll thread.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(poll)), 0.3)
            await asyncio.sleep(0)  # let _on_poll_done run
        with self._arrival_lock:
            self._closed = True  # a poll finishing from now on releases its own messages
        self._take_arrived()
        self._buffer.clear()
        while self._deletes or self._delete_busy:  # acks handed to the deleter finish first
            await asyncio.sleep(0.01)
        if self._deleter is not None:
            self._deleter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._deleter
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._heartbeat_task
        while self._release_busy:  # a batch already sent finishes first
            await asyncio.sleep(0.01)
        if self._releaser is not None:
            self._releaser.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._releaser
        leftover = self._releases + list(self._inflight.values())
        self._releases = []
        self._inflight.clear()
        if leftover:
            await self._release(leftover)
        self._runner.shutdown()
        log.info("sqs source closed queue=%s", self.queue_url)

    async def pending_work(self) -> int:
        """Visible + in flight (any worker's, a killed one's too) + delayed messages.

        Raises when SQS cannot be asked: an unreachable queue is not an empty one.
        """
        attrs = (
            await self._call(
                "get_queue_attributes", QueueUrl=self.queue_url, AttributeNames=PENDING_ATTRIBUTES
            )
        ).get("Attributes", {})
        return sum(int(attrs.get(name, "0")) for name in PENDING_ATTRIBUTES)

    @property
    def inflight(self) -> int:
        """Messages received and neither acked, abandoned nor dead-lettered."""
        return len(self._inflight)

    def uncommitted_count(self) -> int:
        """``qworker_uncommitted_offsets``: messages received and not yet deleted."""
        return len(self._inflight)

    async def extend_visibility(self) -> None:
        """Reset the visibility timeout of every in-flight message (concurrent batches of 10)."""
        msgs = list(self._inflight.values())
        if msgs:
            self.heartbeats += await self._change_visibility(
                msgs, self.visibility_timeout, "visibility heartbeat"
            )

    async def _heartbeat_loop(self) -> None:
        # Rounds are timed from their start: a slow round must not push the next one
        # past the visibility timeout. A round that overruns is followed at once.
        next_at = time.monotonic() + self.heartbeat_interval
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            started = time.monotonic()
            await self.extend_visibility()
            took = time.monotonic() - started
            if took > self.visibility_timeout / 3:
                self.slow_heartbeats += 1
                log.warning(
                    "sqs visibility heartbeat took %.1fs (visibility timeout %ds): "
                    "messages may be redelivered; consider a longer sqs_visibility_timeout",
                    took,
                    self.visibility_timeout,
                )
            next_at = max(started + self.heartbeat_interval, time.monotonic())


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str((response or {}).get("Error", {}).get("Code", "")) if isinstance(
        response, dict) else ""


def _is_missing_queue(exc: BaseException) -> bool:
    return _error_code(exc) in ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist")


def open_source(uri: str, settings: Any) -> SqsSource:
    """Build (not start) the SQS source for ``sqs://QUEUE_URL_OR_NAME`` from ``WorkerSettings``."""
    client = make_client("sqs", sqs_options(settings))
    return SqsSource(
        client,
        parse_sqs_uri(uri),
        visibility_timeout=getattr(settings, "sqs_visibility_timeout", 300),
        dlq_url=getattr(settings, "sqs_dlq_url", None),
    )


async def produce(uri: str, items: Iterable[tuple[str | None, bytes]], settings: Any) -> int:
    """Send every ``(key, body)`` to the queue (``send_message_batch``, 10 a call).

    The key (custom_id) travels as the ``custom_id`` message attribute; on a FIFO
    queue it is also the MessageGroupId. Raises if SQS refuses any entry.
    """
    client = make_client("sqs", sqs_options(settings))
    queue = parse_sqs_uri(uri)
    if queue.startswith(("http://", "https://")):
        url = queue
    else:
        url = (await asyncio.to_thread(client.get_queue_url, QueueName=queue))["QueueUrl"]
    fifo = url.endswith(".fifo")
    count = 0
    batch: list[dict[str, Any]] = []

    async def flush() -> None:
        nonlocal batch
        if not batch:
            return
        resp = await asyncio.to_thread(client.send_message_batch, QueueUrl=url, Entries=batch)
        if resp.get("Failed"):
            raise RuntimeError(f"SQS refused {len(resp['Failed'])} messages: {resp['Failed'][:3]}")
        batch = []

    for key, body in items:
        entry: dict[str, Any] = {"Id": str(len(batch)), "MessageBody": body.decode("utf-8")}
        if key:
            entry["MessageAttributes"] = {KEY_ATTRIBUTE: {"DataType": "String", "StringValue": key}}
        if fifo:
            entry["MessageGroupId"] = key or "default"
            # Content-based: a producer re-sending the same job within 5 min is deduplicated.
            entry["MessageDeduplicationId"] = hashlib.sha256(
                (key or "").encode() + b"\0" + body
            ).hexdigest()
        batch.append(entry)
        count += 1
        if len(batch) == MAX_BATCH:
            await flush()
    await flush()
    return count
