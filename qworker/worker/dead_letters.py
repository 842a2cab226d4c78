"""Dead letters: to the source's dead-letter target, else to the sink; never only logged.

A message that cannot be a job (docs/formats.md, "Dead letters") goes to the source's
target (``<topic>.dlq``, the SQS DLQ, ``<spool>.dlq``) through the dead-letter
``Retrier``: a failing target is retried for the outage budget, never dropped. Where
no target exists (SQS without a redrive policy or ``QWORKER_SQS_DLQ_URL``), or the
target refuses this one message for good (too large, invalid for it), it is written to
the sink as ``<prefix>/_dead_letters/<source>-<safe(message id)>.json`` with the
reason, the source position and the body (base64). When neither can take it before
the budget or the drain runs out, the message is handed back (redelivered later).
``deliver`` decides and reports; ``settle`` makes the source calls.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

from qworker.schema import dead_letter_key
from qworker.schema.peek import peek_ids
from qworker.worker.result_writer import ResultWriter, Stored
from qworker.worker.retry import GaveUp, GiveUp, Retrier
from qworker.worker.sources.base import Message, Source

log = logging.getLogger(__name__)


class Delivered(Enum):
    """Where a dead letter went."""

    TARGET = "target"  # the source's dead-letter target (the source acked it)
    SINK = "sink"  # <prefix>/_dead_letters/ in the sink (to be acked)
    NOWHERE = "nowhere"  # neither could take it in time: hand the message back


def dead_letter_record(msg: Message, reason: str, source: Source) -> dict[str, Any]:
    """The record written under ``_dead_letters/`` for ``msg`` (docs/formats.md)."""
    ids = peek_ids(msg.body)
    size = msg.size if msg.size is not None else len(msg.body)
    return {
        "object": "qworker.dead_letter",
        "source": source.kind,
        "message_id": msg.message_id,
        "position": source.position(msg),
        "reason": reason,
        "custom_id": ids.custom_id,
        "batch_id": ids.batch_id,
        "size": size,
        "body_truncated": len(msg.body) < size,
        "body_base64": base64.b64encode(msg.body).decode("ascii"),
        "received_at": msg.received_at,
        "dead_lettered_at": time.time(),
    }


class DeadLetters:
    """Delivers dead letters for one worker; see the module docstring."""

    def __init__(self, source: Source, retrier: Retrier, writer: ResultWriter) -> None:
        self.source = source
        self.retrier = retrier
        self.writer = writer

    async def deliver(self, msg: Message, reason: str,
                      send: Callable[[], Awaitable[None]]) -> tuple[Delivered, str]:
        """Dead-letter ``msg``: ``send()`` to the target first, if the source has one.

        Returns where it went and the reason as recorded (a refusal is appended).
        """
        extra = {"message_id": msg.message_id}
        if self.source.has_dead_letter_target:
            try:
                await self.retrier.call(send, "dead letter", extra)
                return Delivered.TARGET, reason
            except GaveUp as gave_up:
                if gave_up.why is not GiveUp.REFUSED:
                    log.error("dead letter not sent, message handed back: %s", gave_up.cause,
                              extra=extra)
                    return Delivered.NOWHERE, reason
                reason = f"{reason} (the dead-letter target refused it: {gave_up.cause})"
        record = dead_letter_record(msg, reason, self.source)
        key = dead_letter_key(self.writer.prefix, self.source.kind, msg.message_id)
        outcome = await self.writer.store(key, record, None, log_extra=extra)
        if outcome.stored in (Stored.WRITTEN, Stored.DUPLICATE):
            log.warning("dead letter written to the sink at %s: %s", key, reason, extra=extra)
            return Delivered.SINK, reason
        log.error("dead letter could not be written to the sink (%s), message handed back",
                  outcome.refusal or outcome.stored.value, extra=extra)
        return Delivered.NOWHERE, reason
