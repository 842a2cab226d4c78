"""boto3 clients for the worker's AWS edges (S3 sink, SQS source).

One place decides endpoints, region, timeouts and retries:

- Endpoints come from the settings (``s3_endpoint_url`` / ``sqs_endpoint_url``, which
  ``WorkerSettings`` already fills from ``AWS_ENDPOINT_URL_S3`` / ``_SQS`` /
  ``AWS_ENDPOINT_URL``); None lets boto3 resolve the real AWS endpoint.
- botocore's own retries are off for S3 (``total_max_attempts=1``): the S3 sink runs its
  own policy (exponential backoff with full jitter, 412 is a duplicate), and two stacked
  retry loops would multiply the worst-case latency. SQS keeps botocore's "standard" mode
  with a few attempts: its calls are idempotent and the source has no policy of its own.
- ``auth_error`` turns a refused call at start (unknown key, bad signature, expired
  token, AccessDenied) into one ``AuthError`` line naming what to check (exit 1,
  docs/operations.md).
- boto3 clients are thread-safe; sessions are not, so each client gets its own session.
  Callers run every client call on a thread pool (``run_blocking``), never on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from qworker.worker.failures import (
    AWS_CREDENTIAL_CODES,
    AWS_DENIED_CODES,
    AuthError,
    auth_failure,
    aws_error,
)

T = TypeVar("T")


def auth_error(exc: BaseException, what: str) -> AuthError | None:
    """An ``AuthError`` for ``what`` (e.g. "sqs queue 'jobs'") when AWS refused the call's
    credentials or permission (in ``exc`` or its causes), else None."""
    cause = auth_failure(exc)
    if cause is None:
        return None
    if isinstance(cause, AuthError):
        return cause
    code, message = aws_error(cause)
    if not code:
        code, message = type(cause).__name__, str(cause)
    detail = f"{code}: {' '.join(message.split())}" if message else code
    if code in AWS_DENIED_CODES or code in ("403", "Forbidden"):
        hint = "the credentials are valid but their IAM policy does not allow this call"
    elif code in AWS_CREDENTIAL_CODES:
        hint = ("AWS refused the credentials: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_SESSION_TOKEN or the role")
    else:
        hint = "no usable AWS credentials: set them or give the pod/task a role"
    return AuthError(f"{what}: {detail} ({hint})")


@dataclass(slots=True)
class ClientOptions:
    """Connection settings for one boto3 client.

    ``read_timeout`` must exceed any server-side wait (SQS long polling waits up to
    20 s). ``max_attempts`` counts the first try; 1 disables botocore's retries.
    """

    endpoint_url: str | None = None
    region: str = "us-east-1"
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_attempts: int = 1
    max_pool_connections: int = 32


def make_client(service: str, options: ClientOptions) -> Any:
    """Create a boto3 client for ``service`` (``"s3"`` or ``"sqs"``) with ``options``.

    Imports boto3 lazily so modules that merely reference this one stay importable
    without it.
    """
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        retries={"total_max_attempts": options.max_attempts, "mode": "standard"},
        max_pool_connections=options.max_pool_connections,
        # Path-style keeps local endpoints (moto, a proxy) free of bucket DNS names.
        s3={"addressing_style": "path"} if options.endpoint_url else None,
    )
    session = boto3.session.Session()
    return session.client(
        service, endpoint_url=options.endpoint_url, region_name=options.region, config=config
    )


def s3_options(settings: Any, **overrides: Any) -> ClientOptions:
    """``ClientOptions`` for S3 from ``WorkerSettings`` (retries off: the sink retries)."""
    opts = ClientOptions(
        endpoint_url=getattr(settings, "s3_endpoint_url", None),
        region=getattr(settings, "aws_region", "us-east-1"),
        max_attempts=1,
    )
    for name, value in overrides.items():
        setattr(opts, name, value)
    return opts


def sqs_options(settings: Any, **overrides: Any) -> ClientOptions:
    """``ClientOptions`` for SQS from ``WorkerSettings`` (botocore standard retries)."""
    opts = ClientOptions(
        endpoint_url=getattr(settings, "sqs_endpoint_url", None),
        region=getattr(settings, "aws_region", "us-east-1"),
        read_timeout=30.0,
        max_attempts=4,
    )
    for name, value in overrides.items():
        setattr(opts, name, value)
    return opts


class BlockingRunner:
    """Runs blocking (boto3) calls on a private thread pool with a wall-clock timeout.

    A private pool keeps long SQS polls from starving S3 puts in asyncio's default
    executor. On timeout the awaiting coroutine gets ``TimeoutError``; the thread
    itself cannot be interrupted and finishes in the background (botocore's own
    connect/read timeouts bound it).
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix=name
        )

    async def run(self, timeout: float, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the pool; raise ``TimeoutError`` after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        return await asyncio.wait_for(future, timeout)

    def shutdown(self) -> None:
        """Stop accepting work; running calls finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
