"""The sink interface: where result records go (S3, a local directory)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PutResult:
    """What one ``Sink.put`` found.

    ``written`` False means the key already held an object (the first write won);
    ``stored_fingerprint`` is then that object's request fingerprint (None when it
    carries none, e.g. written by an older qworker).
    """

    written: bool
    stored_fingerprint: str | None = None


class SinkError(OSError):
    """One ``put`` failed without storing anything for sure; the caller retries it."""


class Sink(ABC):
    """Stores one result object per key; the first write wins.

    Coroutines called from the worker's event loop; none may block it. A sink makes
    one attempt per call: retries, backoff and outage budgets belong to the caller
    (``qworker.worker.result_writer``), so there is one retry loop, not two stacked.
    """

    @abstractmethod
    async def check(self) -> None:
        """Verify at start that results can be stored (the bucket exists, the dir is usable).

        Raises ``StartupError`` naming the problem (exit 1: retrying cannot help).
        """

    @abstractmethod
    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        """Write ``body`` under ``key`` (with the request's ``fingerprint``) unless it exists.

        Raises ``SinkError`` when the attempt failed.
        """

    async def get(self, key: str) -> bytes | None:
        """The object at ``key``, or None when there is none (one attempt; raises on failure).

        Read by the cancel watch (qworker/worker/cancel_watch.py) for a batch's marker.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot read objects back")

    @abstractmethod
    async def close(self) -> None:
        """Flush anything pending and release connections; idempotent."""
