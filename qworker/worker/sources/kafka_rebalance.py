"""Partition bookkeeping of the Kafka source across eager rebalances.

aiokafka's eager protocol revokes every partition on each rebalance, then assigns
the new set. ``PartitionBook`` parks revoked partitions (their in-flight jobs keep
running, their buffered messages wait), brings back those that return, and reports
the in-flight messages of those that moved elsewhere. An *epoch* per assignment
lets the source ignore acks for messages handed out under an earlier one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import ConsumerRebalanceListener, TopicPartition

from qworker.worker.offsets import PartitionWatermark
from qworker.worker.sources.base import Message


@dataclass(slots=True)
class KafkaHandle:
    """``Message.handle`` of a Kafka message: where it came from, under which assignment."""

    tp: TopicPartition
    offset: int
    epoch: int


@dataclass(slots=True)
class PartitionState:
    """What the source knows about one assigned partition."""

    epoch: int
    watermark: PartitionWatermark
    inflight: dict[int, Message] = field(default_factory=dict)
    parked: list[Message] = field(default_factory=list)


class PartitionBook:
    """The owned and the parked (revoked, maybe coming back) partitions of one member.

    Not thread-safe: used from the source's event loop only.
    """

    def __init__(self) -> None:
        self.owned: dict[TopicPartition, PartitionState] = {}
        self.parked: dict[TopicPartition, PartitionState] = {}
        self._epoch = 0

    def owner(self, handle: KafkaHandle) -> PartitionState | None:
        """The state ``handle`` belongs to, or None if its assignment is gone."""
        part = self.owned.get(handle.tp) or self.parked.get(handle.tp)
        if part is None or part.epoch != handle.epoch:
            return None
        return part

    def park(self, revoked: set[TopicPartition], buffer: deque[Message]) -> deque[Message]:
        """Park ``revoked``; return ``buffer`` less their messages (kept with the parked state)."""
        for tp in revoked:
            part = self.owned.pop(tp, None)
            if part is not None:
                self.parked[tp] = part
        kept: deque[Message] = deque()
        for msg in buffer:
            parked = self.parked.get(msg.handle.tp)
            if parked is not None:
                parked.parked.append(msg)
            else:
                kept.append(msg)
        return kept

    async def assign(
        self,
        assigned: set[TopicPartition],
        still_ours: Callable[[TopicPartition, PartitionState], Awaitable[bool]],
        buffer: deque[Message],
    ) -> list[Message]:
        """Take ``assigned``: parked ones that came back (and ``still_ours``) resume.

        A resumed partition's parked messages go back on ``buffer`` as it resumes.
        Returns the in-flight messages of partitions that moved elsewhere (to abort).
        Newly assigned partitions start fresh under a new epoch.
        """
        lost: list[Message] = []
        for tp, part in self.parked.items():
            if tp in assigned and await still_ours(tp, part):
                self.owned[tp] = part
                buffer.extend(part.parked)
                part.parked = []
            else:
                lost.extend(part.inflight.values())
        self.parked = {}
        for tp in assigned:
            if tp not in self.owned:
                self._epoch += 1
                self.owned[tp] = PartitionState(self._epoch, PartitionWatermark())
        return lost


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Forwards aiokafka's rebalance callbacks (as plain sets) to two coroutines."""

    def __init__(
        self,
        on_revoked: Callable[[set[TopicPartition]], Awaitable[None]],
        on_assigned: Callable[[set[TopicPartition]], Awaitable[None]],
    ) -> None:
        self._on_revoked = on_revoked
        self._on_assigned = on_assigned

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Called by aiokafka before a rebalance."""
        await self._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Called by aiokafka once the new assignment is known."""
        await self._on_assigned(set(assigned))
