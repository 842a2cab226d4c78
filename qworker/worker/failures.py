"""Failures that decide how ``qworker run`` ends (the exit codes of docs/operations.md)."""

from __future__ import annotations


class StartupError(RuntimeError):
    """A configuration problem found at start: a missing queue, topic, bucket or model.

    Printed as one line, exit 1: retrying the same command cannot help.
    """


class SourceUnavailableError(ConnectionError):
    """The source cannot reach its server now; the worker retries within its outage budget.

    ``fatal`` True means retrying cannot help either (a Kafka batch that cannot be
    decoded): the worker stops at once with exit 69.
    """

    fatal = False
