"""S3 result sink: one object per job, first write wins, the request's fingerprint beside it.

``put`` writes with ``IfNoneMatch="*"``: S3 refuses to overwrite an existing key
with 412 PreconditionFailed, which this sink reports as "not written" together with
the stored object's fingerprint (its ``x-amz-meta-qworker-fingerprint``, read with a
HEAD), so the caller can tell a redelivery (same fingerprint) from a second request
under the same custom_id (docs/formats.md, fingerprints and conflicts). That also
covers our own earlier attempt whose response was lost (a timeout or a reset after
S3 stored the object): the retry sees 412 and the result is there.

One attempt per ``put``: every failure (throttling, 5xx, 409 ConditionalRequestConflict
of a concurrent conditional write, timeouts, resets, AccessDenied) raises
``S3WriteError`` and the caller's single retry loop (``qworker.worker.result_writer``)
decides when to try again. botocore's own retries are off (``qworker.worker.aws``).
A 4xx about this one object (its key, size or metadata) raises ``S3Refused``: a
permanent refusal of that object, not an outage (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from qworker.worker.aws import BlockingRunner, auth_error, make_client, s3_options
from qworker.worker.failures import AuthError, Refused, StartupError
from qworker.worker.sinks.base import PutResult, Sink, SinkError

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


#: Answers that refuse this one object for good (not the bucket, not the credentials).
_REFUSED_CODES = frozenset(
    {
        "EntityTooLarge",
        "KeyTooLongError",
        "MetadataTooLarge",
        "InvalidArgument",
        "InvalidObjectName",
        "InvalidRequest",
        "InvalidDigest",
        "BadDigest",
    }
)


#: The key (under the sink's prefix) ``check`` asks S3 about; nothing is ever stored there.
ACCESS_PROBE_KEY = "_qworker-access-check"
#: An ETag no object has (not an MD5): a put conditional on it never writes.
_NO_ETAG = '"qworker-access-check"'

#: The object metadata key holding the request fingerprint (``x-amz-meta-...``).
FINGERPRINT_META = "qworker-fingerprint"


class S3WriteError(SinkError):
    """One write to S3 failed; ``transient`` tells throttling/5xx/timeouts from the rest."""

    def __init__(self, message: str, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


class S3Refused(S3WriteError, Refused):
    """S3 refuses this one object for good (a 4xx about its key, size or metadata)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)


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
    """``"duplicate"``, ``"retry"``, ``"refused"`` (this object, for good) or ``"fatal"``
    for an exception from ``put_object``."""
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
        if code in _REFUSED_CODES or status == 413:
            return "refused"
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
    ``concurrency`` threads with ``call_timeout`` seconds each.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        prefix: str = "",
        call_timeout: float = 60.0,
        concurrency: int = 16,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.call_timeout = call_timeout
        self._runner = BlockingRunner(concurrency, "qworker-s3")
        self._slots = asyncio.Semaphore(concurrency)
        self._closed = False

    async def _call(self, method: str, **kwargs: Any) -> Any:
        # Wait for a free thread first, so call_timeout covers the call itself and not
        # the time spent queued behind other calls.
        async with self._slots:
            return await self._runner.run(
                self.call_timeout, getattr(self.client, method), **kwargs
            )

    async def check(self) -> None:
        """The bucket exists and these credentials may write and read results under the
        prefix (docs/operations.md, "Startup checks"), without storing anything.

        HEAD bucket, then a ``PutObject`` conditional on an ETag no object has
        (``If-Match``) and a ``HeadObject`` of ``ACCESS_PROBE_KEY``: S3 authorizes a
        request before it evaluates the condition, so an allowed put is refused 404/412
        and a denied one 403. ``StartupError`` / ``AuthError`` naming the problem.
        """
        await self._check_bucket()
        key = f"{self.prefix}/{ACCESS_PROBE_KEY}" if self.prefix else ACCESS_PROBE_KEY
        where = f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}*"
        for method, extra, action in (("put_object", {"Body": b"", "IfMatch": _NO_ETAG},
                                       "s3:PutObject"), ("head_object", {}, "s3:GetObject")):
            try:
                await self._call(method, Bucket=self.bucket, Key=key, **extra)
            except Exception as exc:
                refused = auth_error(exc, f"s3 sink {where}: {action} refused")
                if refused is not None:
                    raise refused from None
                # 404 / 412: allowed. Anything else is found again on the first write.
                if classify_error(exc) == "retry":
                    log.warning("s3 %s check of %s could not be made (will retry on use): "
                                "%s", action, self.bucket, exc)
                    return

    async def _check_bucket(self) -> None:
        try:
            await self._call("head_bucket", Bucket=self.bucket)
        except Exception as exc:
            if auth_error(exc, "") is not None:
                # HEAD answers carry no error code: a 403 is an unknown key, a bad
                # signature, an expired token or a policy without s3:ListBucket alike.
                raise AuthError(
                    f"s3 bucket {self.bucket!r}: HeadBucket refused (403 Forbidden): check "
                    "the AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                    "AWS_SESSION_TOKEN or the role) and that its policy allows s3:ListBucket "
                    "on the bucket") from None
            if classify_error(exc) in ("fatal", "refused"):
                raise StartupError(
                    f"s3 bucket {self.bucket!r} is not usable: {_describe(exc)}"
                ) from None
            log.warning("s3 bucket %s could not be checked (will retry on use): %s",
                        self.bucket, exc)

    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        """Write ``body`` at ``key`` unless it exists (one attempt); see the module docstring.

        Raises ``S3WriteError`` when the attempt failed.
        """
        metadata = {FINGERPRINT_META: fingerprint} if fingerprint else {}
        try:
            await self._call(
                "put_object",
                Bucket=self.bucket,
                Key=key,
                Body=body,
                IfNoneMatch="*",
                ContentType="application/json",
                Metadata=metadata,
            )
            return PutResult(True)
        except Exception as exc:
            kind = classify_error(exc)
            if kind == "refused":
                raise S3Refused(f"s3 refused s3://{self.bucket}/{key}: {_describe(exc)}") from exc
            if kind != "duplicate":
                raise S3WriteError(
                    f"s3 put s3://{self.bucket}/{key} failed: {_describe(exc)}",
                    transient=kind == "retry",
                ) from exc
        log.info("s3 put duplicate key=%s (an object already exists)", key)
        return PutResult(False, await self._stored_fingerprint(key))

    async def get(self, key: str) -> bytes | None:
        """GET ``key`` on the sink's thread pool (None on NoSuchKey); one attempt."""
        try:
            response = await self._call("get_object", Bucket=self.bucket, Key=key)
        except Exception as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return await self._runner.run(self.call_timeout, lambda: bytes(response["Body"].read()))

    async def _stored_fingerprint(self, key: str) -> str | None:
        try:
            head = await self._call("head_object", Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise S3WriteError(
                f"s3 head s3://{self.bucket}/{key} failed: {_describe(exc)}",
                transient=classify_error(exc) != "fatal",
            ) from exc
        value = (head.get("Metadata") or {}).get(FINGERPRINT_META)
        return str(value) if value else None

    async def close(self) -> None:
        """Release the thread pool; idempotent. Puts already awaited have completed."""
        if not self._closed:
            self._closed = True
            self._runner.shutdown()


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def open_sink(uri: str, settings: Any) -> S3Sink:
    """Build the S3 sink for ``s3://bucket/prefix`` (keys given to ``put`` include the prefix)."""
    bucket, prefix = parse_s3_uri(uri)
    return S3Sink(make_client("s3", s3_options(settings)), bucket, prefix=prefix)


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
