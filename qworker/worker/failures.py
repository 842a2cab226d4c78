"""Failures that decide how a call, a message or ``qworker run`` ends (docs/operations.md).

``qworker.worker.retry.classify`` turns these into verdicts: ``StartupError`` is a
configuration problem (exit 1), ``Refused`` a permanent refusal of one item (not an
outage), a fatal ``SourceUnavailableError`` stops the worker (exit 69); anything else
is transient and retried within the outage budget.
"""

from __future__ import annotations


class StartupError(RuntimeError):
    """A configuration problem: a missing queue, topic, bucket, dead-letter target or model.

    Printed as one line, exit 1: retrying the same command cannot help.
    """


class SourceUnavailableError(ConnectionError):
    """The source cannot reach its server now; the worker retries within its outage budget.

    ``fatal`` True means retrying cannot help either (a Kafka batch that cannot be
    decoded): the worker stops at once with exit 69.
    """

    fatal = False


class Refused(Exception):
    """A dependency answered and refuses this one item for good (a 4xx for this message).

    Examples: an SQS dead-letter queue whose size limit the message exceeds, a Kafka
    dead-letter topic refusing a record as too large, an S3 key or body S3 will not
    take. Not retried, not an outage: the item gets another fate (docs/operations.md).
    """
