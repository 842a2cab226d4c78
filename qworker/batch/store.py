"""The stored objects of a batch: an S3 prefix or a directory, listed and fetched fast.

``open_store(uri, settings)`` takes a results location (``s3://bucket/prefix`` or
``file:///dir``, as the worker's sink). Scale (docs/benchmarks.md, "collect"):

- listing: ListObjectsV2 pages of 1000 keys; given split points (the sorted expected
  keys of a manifest, cut into equal runs), ``parallel`` listers each walk one key
  range (``StartAfter`` = the range's lower bound, stop past its upper bound), so a
  million results list in about a thousand requests spread over threads;
- fetching: ``get_many`` runs GETs on a thread pool and yields results in the order
  asked, with at most ``window`` objects in memory.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from qworker.worker.aws import make_client, s3_options

T = TypeVar("T")
R = TypeVar("R")

#: Concurrent GETs / listers (boto3's connection pool is sized to match).
DEFAULT_WORKERS = 64


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], workers: int, window: int | None = None
) -> Iterator[R]:
    """``map(fn, items)`` on a thread pool, in order, at most ``window`` results pending."""
    window = window or workers * 4
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[concurrent.futures.Future[R]] = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class BatchStore:
    """Where results live; keys are complete (prefix included), as the worker writes them."""

    prefix: str = ""

    def list_names(self, folder: str, split_after: list[str] | None = None) -> list[str]:
        """Keys directly under ``folder`` (ending in ``/``), sorted; no sub-folders.

        ``split_after``: sorted keys at which to cut the listing into parallel ranges.
        """
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""
        raise NotImplementedError

    def put(self, key: str, body: bytes) -> None:
        """Write (or replace) one small object."""
        raise NotImplementedError

    def put_new(self, key: str, body: bytes) -> bool:
        """Write one small object unless ``key`` exists; False (nothing written) if it does."""
        raise NotImplementedError

    def get_many(self, keys: Iterable[str], workers: int = DEFAULT_WORKERS,
                 window: int | None = None) -> Iterator[tuple[str, bytes | None]]:
        """``(key, bytes or None)`` for each key, in the order given, fetched in parallel."""
        return ordered_map(lambda k: (k, self.get(k)), keys, workers, window)


class S3Store(BatchStore):
    """A results prefix in one bucket; boto3's client is shared by the threads (thread-safe)."""

    def __init__(self, client: Any, bucket: str, prefix: str, workers: int = DEFAULT_WORKERS):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.workers = workers
        self.list_requests = 0
        self._lock = threading.Lock()

    def _list_range(self, folder: str, after: str | None, until: str | None) -> list[str]:
        out: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": folder, "Delimiter": "/",
                                  "MaxKeys": 1000}
        if after is not None:
            kwargs["StartAfter"] = after
        while True:
            page = self.client.list_objects_v2(**kwargs)
            with self._lock:
                self.list_requests += 1
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if until is not None and key > until:
                    return out
                out.append(key)
            if not page.get("IsTruncated"):
                return out
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
            kwargs.pop("StartAfter", None)

    def list_names(self, folder: str, split_after: list[str] | None = None) -> list[str]:
        """See ``BatchStore.list_names``; ranges run on up to ``workers`` threads."""
        bounds = [b for b in (split_after or []) if b.startswith(folder)]
        ranges = list(zip([None, *bounds], [*bounds, None], strict=True))
        if len(ranges) == 1:
            return self._list_range(folder, None, None)
        with concurrent.futures.ThreadPoolExecutor(min(self.workers, len(ranges))) as pool:
            parts = list(pool.map(lambda r: self._list_range(folder, *r), ranges))
        return [key for part in parts for key in part]

    def get(self, key: str) -> bytes | None:
        """GET one object (None on NoSuchKey); botocore retries transient errors."""
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except Exception as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def put(self, key: str, body: bytes) -> None:
        """PUT one object (replacing it)."""
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body,
                               ContentType="application/json")

    def put_new(self, key: str, body: bytes) -> bool:
        """PUT with ``IfNoneMatch="*"``: S3 answers 412 (or 409 for a racing put) if it exists."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*",
                                   ContentType="application/json")
        except Exception as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise
        return True


class DirStore(BatchStore):
    """A ``file://`` results directory (the worker's file sink)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prefix = ""

    def list_names(self, folder: str, split_after: list[str] | None = None) -> list[str]:
        """See ``BatchStore.list_names`` (one scandir; ``split_after`` is not needed)."""
        path = self.root / folder
        if not path.is_dir():
            return []
        with os.scandir(path) as it:
            names = [e.name for e in it if e.is_file() and not e.name.startswith(".tmp-")]
        return sorted(folder + n for n in names)

    def get(self, key: str) -> bytes | None:
        """The file's bytes, or None."""
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, body: bytes) -> None:
        """Write atomically (a temporary file renamed into place)."""
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        tmp.write_bytes(body)
        os.replace(tmp, target)

    def put_new(self, key: str, body: bytes) -> bool:
        """Write a temporary file and hard-link it into place: the link fails if it exists."""
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        tmp.write_bytes(body)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        return True


def open_store(uri: str, settings: Any, workers: int = DEFAULT_WORKERS) -> BatchStore:
    """The store of a results location: ``s3://bucket/prefix`` or ``file:///dir``."""
    scheme, sep, rest = uri.partition("://")
    if scheme == "s3" and sep:
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ValueError(f"results location {uri!r} has no bucket")
        options = s3_options(settings, max_attempts=5, max_pool_connections=workers + 4)
        return S3Store(make_client("s3", options), bucket, prefix.strip("/"), workers)
    if scheme == "file" and sep and rest:
        return DirStore(Path(rest))
    raise ValueError(f"results location {uri!r} must be s3://bucket/prefix or file:///path/dir")
