"""The exit codes of ``qworker run`` (docs/formats.md, "Exit codes"; when: docs/operations.md).

AWS Batch ``evaluateOnExit`` and Kubernetes restart policies key on them: only 0 and
1 mean "do not retry".
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Why ``qworker run`` stopped; the values follow BSD ``sysexits.h`` where one fits."""

    #: Done: ``--until-idle`` saw nothing in flight and no pending work at the source,
    #: or a drain that left no work anywhere.
    OK = 0
    #: Usage or configuration error, a missing queue / topic / bucket, a model that
    #: cannot load: retrying the same command cannot help.
    CONFIG = 1
    #: The source, the sink or the dead-letter target was unreachable for longer than
    #: its outage budget, or a Kafka batch could not be decoded (``EX_UNAVAILABLE``).
    UNAVAILABLE = 69
    #: The engine failed: repeated step failures, a step past the step timeout, or a
    #: dead engine thread (``EX_SOFTWARE``).
    ENGINE = 70
    #: Drained by SIGTERM or a spot notice with work possibly left (``EX_TEMPFAIL``).
    DRAINED = 75
