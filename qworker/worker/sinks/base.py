"""The sink interface: where result records go (S3, a local directory)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Sink(ABC):
    """Stores one result object per key; the first write wins.

    Coroutines called from the worker's event loop; none may block it.
    """

    @abstractmethod
    async def put(self, key: str, body: bytes) -> bool:
        """Write ``body`` under ``key`` unless it exists.

        Returns True when written, False when the key already existed (a duplicate:
        S3's 412, or an existing file). Retries transient failures itself and raises
        only after the retries are exhausted.
        """

    @abstractmethod
    async def close(self) -> None:
        """Flush anything pending and release connections; idempotent."""
