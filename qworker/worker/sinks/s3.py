"""S3 result sink: one object per job, first write wins, transient failures retried.

``put`` writes with ``IfNoneMatch="*"``: S3 refuses to overwrite an existing key
with 412 PreconditionFailed, which this sink reports as a duplicate (False).
That also covers our own earlier attempt whose response was lost (a timeout or a
reset after S3 stored the object): the retry sees 412 and the result is there.

409 ConditionalRequestConflict (a concurrent conditional write to the same key is
in flight) is retried, not counted as a duplicate: the other writer may still
fail, and the retry resolves to 412 (it won) or 200 (it did not).

Retry policy: throttling (SlowDown, 503), other 5xx, 409 conflicts, timeouts and
connection errors are retried with exponential backoff and full jitter
(``sleep = uniform(0, min(max_delay, base_delay * 2**attempt))``) up to
``max_attempts`` tries, then ``S3WriteError`` is raised. Other client errors
(AccessDenied, NoSuchBucket, ...) raise at once. botocore's own retries are off
(see ``qworker.worker.aws``), so this is the only retry loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

from qworker.worker.aws import BlockingRunner, make_client, s3_options
from qworker.worker.sinks.base import Sink

log = logging.getLogger(__name__)

_DUPLICATE_CODES = frozenset({"PreconditionFailed"})
_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "ServerError",
        "ConditionalRequestConflict",
        "OperationAborted",
        "BadGateway",
        "GatewayTimeout",
    }
)


class S3WriteError(OSError):
    """A result could not be written to S3 after every retry (or hit a permanent error)."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)`` (prefix without slashes at ends)."""
    scheme, sep, rest = uri.partition("://")
    if scheme != "s3" or not sep:
        raise ValueError(f"sink URI {uri!r} must be s3://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"sink URI {uri!r} has no bucket")
    return bucket, prefix.strip("/")


def classify_error(exc: BaseException) -> str:
    """Return ``"duplicate"``, ``"retry"`` or ``"fatal"`` for an exception from ``put_object``."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in _DUPLICATE_CODES or status == 412:
            return "duplicate"
        if code in _RETRY_CODES or status >= 500 or status in (409, 429):
            return "retry"
        return "fatal"
    if isinstance(exc, ConnectionError | HTTPClientError | IncompleteReadError | TimeoutError):
        return "retry"
    if isinstance(exc, BotoCoreError):
        return "fatal"
    if isinstance(exc, OSError):
        return "retry"
    return "fatal"


class S3Sink(Sink):
    """Writes result objects to one bucket; keys are complete (prefix included).

    ``client`` is a boto3 S3 client (thread-safe); calls run on a private pool of
    ``concurrency`` threads with ``call_timeout`` seconds each. ``on_retry`` (if set)
    is called once per retried attempt, e.g. to count ``qworker_sink_retries_total``.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        max_attempts: int = 8,
        base_delay: float = 0.05,
        max_delay: float = 5.0,
        call_timeout: float = 60.0,
        concurrency: int = 16,
        on_retry: Callable[[str], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.client = client
        self.bucket = bucket
        self.max_attempts = max_attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.call_timeout = call_timeout
        self.on_retry = on_retry
        self.retries = 0
        self._rng = rng or random.Random()
        self._runner = BlockingRunner(concurrency, "qworker-s3")
        self._slots = asyncio.Semaphore(concurrency)
        self._closed = False

    def backoff(self, attempt: int) -> float:
        """Seconds to sleep before retry number ``attempt`` (0-based): full jitter."""
        return self._rng.uniform(0.0, min(self.max_delay, self.base_delay * (2**attempt)))

    async def put(self, key: str, body: bytes) -> bool:
        """Write ``body`` at ``key`` unless it exists; True written, False duplicate.

        Raises ``S3WriteError`` after ``max_attempts`` transient failures or at the
        first permanent one.
        """
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            try:
                # Wait for a free thread first, so call_timeout covers the call itself and
                # not the time spent queued behind other puts.
                async with self._slots:
                    await self._runner.run(
                        self.call_timeout,
                        self.client.put_object,
                        Bucket=self.bucket,
                        Key=key,
                        Body=body,
                        IfNoneMatch="*",
                        ContentType="application/json",
                    )
                return True
            except Exception as exc:
                kind = classify_error(exc)
                if kind == "duplicate":
                    log.info("s3 put duplicate key=%s (an object already exists)", key)
                    return False
                if kind == "fatal":
                    raise S3WriteError(f"s3 put s3://{self.bucket}/{key} failed: {exc}") from exc
                last = exc
            if attempt + 1 < self.max_attempts:
                self.retries += 1
                if self.on_retry is not None:
                    self.on_retry(type(last).__name__)
                delay = self.backoff(attempt)
                log.warning(
                    "s3 put key=%s attempt %d/%d failed (%s); retrying in %.2fs",
                    key,
                    attempt + 1,
                    self.max_attempts,
                    last,
                    delay,
                )
                await asyncio.sleep(delay)
        raise S3WriteError(
            f"s3 put s3://{self.bucket}/{key} failed after {self.max_attempts} attempts: {last}"
        ) from last

    async def close(self) -> None:
        """Release the thread pool; idempotent. Puts already awaited have completed."""
        if not self._closed:
            self._closed = True
            self._runner.shutdown()


def open_sink(uri: str, settings: Any) -> S3Sink:
    """Build the S3 sink for ``s3://bucket/prefix`` (keys given to ``put`` include the prefix)."""
    bucket, _ = parse_s3_uri(uri)
    return S3Sink(make_client("s3", s3_options(settings)), bucket)


def batch_prefix(prefix: str, batch_id: str) -> str:
    """The key prefix (ending in ``/``) under which ``batch_id``'s results live."""
    from qworker.schema import result_key

    # Derive it from the key scheme itself so the two can never disagree.
    return result_key(prefix, batch_id, "x").rsplit("/", 1)[0] + "/"


def collect(uri: str, batch_id: str, settings: Any) -> Iterator[bytes]:
    """Yield the body of every result object of ``batch_id`` under ``uri``. Blocking.

    Objects are fetched a few at a time in parallel; order is the listing order
    (by key). Retries come from botocore's standard mode here (reads are idempotent).
    """
    import concurrent.futures

    bucket, prefix = parse_s3_uri(uri)
    client = make_client("s3", s3_options(settings, max_attempts=5))
    start = batch_prefix(prefix, batch_id)
    paginator = client.get_paginator("list_objects_v2")

    def fetch(key: str) -> bytes:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        for page in paginator.paginate(Bucket=bucket, Prefix=start):
            keys = [
                obj["Key"]
                for obj in page.get("Contents", [])
                if "/" not in obj["Key"][len(start) :]
            ]
            yield from pool.map(fetch, keys)
