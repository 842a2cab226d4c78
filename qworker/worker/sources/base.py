"""The source interface: where jobs come from (Kafka, SQS, a local file).

A source hands the worker ``Message`` objects and learns each one's fate:
``ack`` once its result is durably in the sink, ``abandon`` when the worker
gave up on it at drain time (it must be redelivered later), ``dead_letter``
when it is not even a JSON object (the source then treats it as acked). The worker
calls these from one place only (``qworker.worker.settle``), once per message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qworker.schema.peek import PeekedIds


@dataclass(slots=True)
class Message:
    """One job as delivered by a source.

    ``message_id`` is human-readable and goes on every log line about the job:
    ``"topic/partition/offset"`` for Kafka, the SQS MessageId, ``"file:<line>"``
    for the file spool. ``handle`` is private to the source that produced it.
    ``size`` is the message's full size in bytes when ``body`` holds only its head (a
    spool line longer than the worker accepts is never read whole), and ``ids`` what
    was read of its top-level ids on the way (``IdScanner``); None otherwise.
    """

    body: bytes
    message_id: str
    key: str | None
    handle: Any
    received_at: float
    size: int | None = None
    ids: PeekedIds | None = None


class Source(ABC):
    """An at-least-once stream of job messages.

    All methods are coroutines called from the worker's event loop; none may block
    it. ``on_revoke`` is set by the worker: the source calls it with in-flight
    messages it can no longer acknowledge (a Kafka rebalance) so the worker aborts
    them; later acks of those messages are ignored by the source.
    """

    on_revoke: Callable[[list[Message]], None] | None = None
    #: The source's scheme, as dead letters written to the sink name it.
    kind: str = "source"

    @property
    def has_dead_letter_target(self) -> bool:
        """False when ``dead_letter`` has nowhere to send (the sink takes dead letters)."""
        return True

    def position(self, msg: Message) -> dict[str, Any]:
        """Where ``msg`` sits in the source (for dead letters written to the sink)."""
        return {"message_id": msg.message_id}

    async def check(self) -> None:
        """Before the model loads: the queue, topic or file and its dead-letter target exist
        and our credentials are accepted (docs/operations.md, "Startup checks").

        Receives nothing and joins no group. Raises ``StartupError`` (``AuthError`` for
        refused credentials) for a configuration problem, anything else when the server
        cannot be reached (retried within the source's outage budget). ``start`` checks
        too when this was not called. The default checks nothing.
        """
        return None

    @abstractmethod
    async def start(self) -> None:
        """Connect / join the group; called once before ``receive``."""

    @abstractmethod
    async def receive(self, max_messages: int, timeout: float) -> list[Message]:
        """Return up to ``max_messages`` new messages, or ``[]`` after ``timeout`` seconds."""

    @abstractmethod
    async def ack(self, msg: Message) -> None:
        """Record that ``msg``'s result is durably in the sink (commit / delete)."""

    @abstractmethod
    async def abandon(self, msg: Message) -> None:
        """Give ``msg`` back unfinished (drain): it must be redelivered, never acked."""

    @abstractmethod
    async def dead_letter(self, msg: Message, reason: str) -> None:
        """Send ``msg`` to the dead-letter target with ``reason``; it then counts as acked.

        Raises ``Refused`` when the target refuses this message for good (too large,
        invalid for it): not an outage. Any other exception is retried.
        """

    @abstractmethod
    async def pending_work(self) -> int:
        """How many messages the source still holds for the fleet (0 = none at all).

        What ``--until-idle`` asks before it may exit 0 (docs/operations.md): SQS counts
        visible, in-flight (held by any worker, a killed one too) and delayed messages;
        Kafka the group's lag (committed offset to end offset) over every partition of
        the topic; a file the lines not yet done. Raises when the source cannot tell
        (unreachable): an error is never "no pending work".
        """

    def uncommitted_count(self) -> int:
        """Messages received here and not yet committed (``qworker_uncommitted_offsets``)."""
        return 0

    @abstractmethod
    async def close(self) -> None:
        """Final commit of finished work and leave the group; idempotent."""
