"""The error hierarchy: one class per result error code (docs/formats.md, "Error lines").

Validation errors subclass ``ValueError`` and name the offending field, so
``LLM.generate`` callers can catch plain ``ValueError`` while the worker maps
``QworkerError.code`` straight onto the ``error.code`` of a result record.
This module imports nothing beyond the standard library: the engine uses it.
"""

from __future__ import annotations


class QworkerError(Exception):
    """Base of every error qworker reports about a job; ``code`` is the result error code."""

    code: str = "engine_error"


class InvalidRequestError(QworkerError, ValueError):
    """A job or parameter is malformed or unsupported (``invalid_request``)."""

    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    """The prompt leaves no room in ``max_model_len`` for a generated token."""

    code = "context_length_exceeded"


class ModelNotFoundError(InvalidRequestError):
    """The job's ``model`` names no model this worker serves (``model_not_found``, a 404).

    docs/formats.md, "Model names": the served name, ``--model`` as given, or an alias.
    """

    code = "model_not_found"
    param = "model"


class BatchExpiredError(QworkerError):
    """The job's ``deadline`` passed before it could be served (``batch_expired``)."""

    code = "batch_expired"


class BatchCancelledError(QworkerError):
    """The job's batch was cancelled (``qworker cancel``) before the job started
    generating (``batch_cancelled``)."""

    code = "batch_cancelled"


class EngineError(QworkerError):
    """The engine failed while serving an otherwise valid job (``engine_error``)."""

    code = "engine_error"


class ModelLoadError(QworkerError, ValueError):
    """The model directory, weights or architecture cannot be loaded."""

    code = "engine_error"


class EngineDeadError(EngineError):
    """The engine cannot step again: a tensor-parallel rank died or hung past its timeout.

    Unlike a failed step, nothing about the jobs in it is to blame; the worker stops
    with exit 70 and hands every job back (docs/operations.md, "Engine failures").
    """
