"""One job's way into and out of the engine, shared by ``qworker run`` and ``qworker generate``.

``prepare`` turns a raw message into a job the engine can take at once (parsed,
tokenized once, validated: an over-long prompt is rejected here, before admission) or
into its outcome without the engine: a dead letter or an error record (a job for the
task this worker does not serve, ``embedding_jobs.task_error``, among them). ``record_for``
turns what the engine returned into the job's result line. Both are plain CPU work:
the worker runs them on a thread pool, never on its event loop. Neither lets an
exception out for bad input: ``job_error`` says what any failure on one job's path
means for its record (an input problem is ``invalid_request``, ours ``server_error``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from qworker.engine.outputs import RequestOutput
from qworker.errors import BatchExpiredError, EngineError, InvalidRequestError, QworkerError
from qworker.schema import Job, JobKind, ParsedJob, error_record_for, parse_job, success_record
from qworker.schema.jobs import logprob_volume_error
from qworker.schema.peek import PeekedIds
from qworker.worker.embedding_jobs import encode_inputs, task_error
from qworker.worker.engine_thread import EmbeddingEngineLike, EngineLike
from qworker.worker.served_models import ServedModels


@dataclass(slots=True)
class Prepared:
    """A valid job with its prompt already tokenized and checked against the engine.

    ``text`` is the prompt text (None for chat jobs and token-id prompts). An embedding
    job has ``input_ids`` (one list per input) and an empty ``token_ids``.
    """

    job: Job
    text: str | None
    token_ids: list[int]
    fingerprint: str | None = None
    input_ids: list[list[int]] | None = None


@dataclass(slots=True)
class Unserved:
    """A message that never reaches the engine: a dead letter, or a job with an error record.

    Exactly one of ``dead_letter`` (the reason) and ``record`` is set.
    """

    custom_id: str | None
    batch_id: str | None
    record: dict[str, Any] | None = None
    dead_letter: str | None = None
    fingerprint: str | None = None
    code: str = ""


def job_error(exc: BaseException, doing: str) -> Exception:
    """What a failure while ``doing`` something for one job means for its record.

    A ``QworkerError`` is itself; too deep a recursion over the job's data, or text
    that is not valid unicode, is the request's fault (``invalid_request``); anything
    else is ours (the record says ``engine_error``, a 500 ``server_error``).
    """
    if isinstance(exc, QworkerError):
        return exc
    if isinstance(exc, RecursionError):
        return InvalidRequestError(f"the request is nested too deeply to {doing}")
    if isinstance(exc, UnicodeError):
        return InvalidRequestError(f"the request holds text that is not valid unicode "
                                   f"({doing}): {exc}")
    return EngineError(f"qworker failed to {doing}: {type(exc).__name__}: {exc}")


def prepare(engine: EngineLike, body: bytes, max_job_bytes: int,
            now: float | None = None, size: int | None = None,
            ids: PeekedIds | None = None,
            served: ServedModels | None = None) -> Prepared | Unserved:
    """Parse, validate and tokenize one message; never raises.

    ``size``: the message's full size when ``body`` is only its head; ``ids``: what a
    scan of the whole message found (``parse_job``). ``served``: the model names the job
    may ask for (default: only ``engine.model_name``); any other is ``model_not_found``.
    """
    try:
        parsed = parse_job(body, max_job_bytes, size, ids)
    except Exception as exc:  # parse_job promises not to raise: a bug, not the job's fault
        return Unserved(None, None, dead_letter=f"qworker could not parse it: "
                        f"{type(exc).__name__}: {exc}", code="dead_letter")
    try:
        return _prepare_parsed(engine, parsed, now, served)
    except Exception as exc:
        error = job_error(exc, "prepare it")
        if not parsed.custom_id:
            return Unserved(None, None, dead_letter=str(error), code="dead_letter")
        return _unserved(parsed.custom_id, parsed.batch_id, error, None, parsed.fingerprint)


def _prepare_parsed(engine: EngineLike, parsed: ParsedJob, now: float | None,
                    served: ServedModels | None) -> Prepared | Unserved:
    fingerprint = parsed.fingerprint
    if parsed.dead_letter is not None:
        return Unserved(parsed.custom_id, parsed.batch_id, dead_letter=parsed.dead_letter,
                        code="dead_letter")
    if parsed.job is None:
        exc = job_error(parsed.error, "validate it") if parsed.error is not None \
            else QworkerError("unparseable job")
        return _unserved(parsed.custom_id or "", parsed.batch_id, exc, None, fingerprint)
    job = parsed.job
    # Whatever the job's kind: never answer a job with a model it did not ask for.
    wrong_model = (served or ServedModels.of(engine.model_name)).check(job.model)
    if wrong_model is not None:
        return _unserved(job.custom_id, job.batch_id, wrong_model, job.metadata, fingerprint)
    wrong_task = task_error(engine.task, job)  # never reaches an engine of the other task
    if wrong_task is not None:
        return _unserved(job.custom_id, job.batch_id, wrong_task, job.metadata, fingerprint)
    expired = expired_error(job, now)
    if expired is not None:
        return _unserved(job.custom_id, job.batch_id, expired, job.metadata, fingerprint)
    if job.kind is JobKind.EMBEDDING:
        try:
            input_ids = encode_inputs(cast(EmbeddingEngineLike, engine), job)
        except Exception as exc:  # empty, too long, bad dimensions: the job's record says so
            return _unserved(job.custom_id, job.batch_id, job_error(exc, "tokenize it"),
                             job.metadata, fingerprint)
        return Prepared(job, None, [], fingerprint, input_ids)
    try:
        text, token_ids = encode(engine, job)
    except Exception as exc:  # no tokenizer / template, too long: the job's record says so
        return _unserved(job.custom_id, job.batch_id, job_error(exc, "tokenize it"),
                         job.metadata, fingerprint)
    if job.want_logprobs and job.params.max_tokens is None:
        # Unbounded output: the cap applies to what the context leaves room for.
        room = max(1, engine.max_model_len - len(token_ids))
        too_many = logprob_volume_error(job.params.n, room, job.top_logprobs)
        if too_many is not None:
            return _unserved(job.custom_id, job.batch_id, too_many, job.metadata, fingerprint)
    return Prepared(job, text, token_ids, fingerprint)


def _unserved(custom_id: str, batch_id: str | None, exc: BaseException,
              metadata: dict[str, Any] | None, fingerprint: str | None) -> Unserved:
    record = error_record_for(custom_id, batch_id, exc, metadata)
    code = exc.code if isinstance(exc, QworkerError) else "engine_error"
    return Unserved(custom_id, batch_id, record=record, fingerprint=fingerprint, code=code)


def encode(engine: EngineLike, job: Job) -> tuple[str | None, list[int]]:
    """``(prompt text or None, token ids)`` of ``job``, validated by the engine.

    Chat messages go through the tokenizer's chat template. Raises the engine's
    ``InvalidRequestError`` / ``ContextLengthExceededError``.
    """
    if job.messages is not None:  # chat and responses jobs
        ids = engine.encode_chat(job.messages or [])
        _, token_ids = engine.validate_prompt(ids, job.params)
        return None, token_ids
    return engine.validate_prompt(job.prompt or "", job.params)


def expired_error(job: Job, now: float | None = None) -> BatchExpiredError | None:
    """The ``batch_expired`` error of a job whose deadline passed before it started."""
    if job.deadline is not None and job.deadline <= (time.time() if now is None else now):
        return BatchExpiredError(f"deadline {job.deadline:.0f} passed before the job started")
    return None


def record_for(
    job: Job,
    output: RequestOutput,
    model: str,
    decode: Callable[[int], str] | None,
    expired: bool = False,
) -> dict[str, Any]:
    """The result line of a job the engine returned.

    ``expired``: the caller aborted it because its deadline passed (``batch_expired``).
    Any other abort (an embedding request returned without embeddings included), or an
    engine error, is an ``engine_error``.
    """
    if expired:
        exc: QworkerError = BatchExpiredError(
            f"deadline {job.deadline:.0f} passed while generating")
    elif output.error is not None:
        exc = EngineError(output.error)
    elif any(c.finish_reason == "abort" for c in output.outputs) or (
            job.kind is JobKind.EMBEDDING and output.embeddings is None):
        exc = EngineError("request aborted by the engine")
    else:
        return success_record(job, output, model, decode)
    return error_record_for(job.custom_id, job.batch_id, exc, job.metadata)


def add_to_engine(engine: EngineLike, request_id: str, prepared: Prepared,
                  arrival_time: float | None = None) -> None:
    """Hand a prepared job to ``engine`` (``add_embedding`` for an embedding job)."""
    job = prepared.job
    if prepared.input_ids is not None:
        cast(EmbeddingEngineLike, engine).add_embedding(request_id, prepared.input_ids,
                                                        job.dimensions, arrival_time)
    else:
        engine.add_validated(request_id, prepared.text, prepared.token_ids, job.params,
                             arrival_time)


def engine_error_record(job: Job, message: str) -> dict[str, Any]:
    """The ``engine_error`` line of a job that kept failing the engine on its own."""
    return error_record_for(job.custom_id, job.batch_id, EngineError(message), job.metadata)


def token_decoder(engine: EngineLike) -> Callable[[int], str] | None:
    """One token id to its text (for logprobs), or None without a tokenizer."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return None
    return lambda tid: tokenizer.decode([tid])
