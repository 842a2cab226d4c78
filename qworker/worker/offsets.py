"""Per-partition commit watermark for the Kafka source.

A Kafka consumer may only commit offset ``N`` when every record below ``N``
has its result durably in the sink. Results finish out of order (short jobs
overtake long ones), so the committable offset is the *watermark*: the lowest
offset fetched but not yet finished, or one past the highest fetched offset
when nothing is outstanding. This module is pure bookkeeping (no I/O, no
asyncio) so it can be tested exhaustively.
"""

from __future__ import annotations

from collections import deque


class PartitionWatermark:
    """Tracks fetched and finished offsets of one partition; tells what may be committed.

    Offsets must be tracked in increasing order (Kafka delivers a partition in
    order; gaps from compaction or transaction markers are fine). ``finish``
    may come in any order. Not thread-safe: the Kafka source uses it from the
    event loop only.
    """

    __slots__ = ("_first", "_live", "_next", "_pending", "committed")

    def __init__(self, committed: int | None = None) -> None:
        # Offsets fetched and not yet popped from the left, in fetch order.
        self._pending: deque[int] = deque()
        # Tracked offsets not yet finished (a subset of ``_pending``).
        self._live: set[int] = set()
        # One past the highest offset tracked so far; None before the first.
        self._next: int | None = committed
        self._first: int | None = committed
        #: The last offset handed to Kafka's commit (set by the caller via ``mark_committed``).
        self.committed: int | None = committed

    def track(self, offset: int) -> bool:
        """Record a fetched offset as in flight; False if it was already tracked (a re-fetch).

        Raises ``ValueError`` for an offset below the highest tracked one that
        was never seen: that would mean the caller skipped ahead and came back.
        """
        if self._next is not None and offset < self._next:
            if offset in self._live or self._is_released(offset) or offset in self._pending:
                return False
            raise ValueError(f"offset {offset} below the tracked range (next {self._next})")
        self._pending.append(offset)
        self._live.add(offset)
        if self._first is None:
            self._first = offset
        self._next = offset + 1
        return True

    def _is_released(self, offset: int) -> bool:
        """True if ``offset`` was finished and already popped below the watermark."""
        return not self._pending or offset < self._pending[0]

    def finish(self, offset: int) -> None:
        """Mark ``offset`` finished (its result is in the sink, or it was dead-lettered).

        Finishing an offset that is not in flight (already finished, or never
        tracked) is a no-op: late or duplicate acks must not move the watermark.
        """
        if offset not in self._live:
            return
        self._live.discard(offset)
        while self._pending and self._pending[0] not in self._live:
            self._pending.popleft()

    @property
    def watermark(self) -> int | None:
        """The offset to commit: lowest unfinished offset, else one past the highest tracked.

        None while nothing was ever tracked (and no committed start was given).
        """
        if self._pending:
            return self._pending[0]
        return self._next

    @property
    def first(self) -> int | None:
        """The committed start given at construction, else the first offset tracked."""
        return self._first

    @property
    def in_flight(self) -> int:
        """Number of tracked offsets not yet finished."""
        return len(self._live)

    @property
    def uncommitted(self) -> int:
        """Offsets fetched past the last commit (finished or not); 0 when fully committed."""
        if self._next is None or self._first is None:
            return 0
        base = self.committed if self.committed is not None else self._first
        return max(0, self._next - base)

    def needs_commit(self) -> bool:
        """True when the watermark moved past the last committed offset."""
        mark = self.watermark
        return mark is not None and (self.committed is None or mark > self.committed)

    def mark_committed(self, offset: int) -> None:
        """Remember that ``offset`` was committed to Kafka (never moves backwards)."""
        if self.committed is None or offset > self.committed:
            self.committed = offset
