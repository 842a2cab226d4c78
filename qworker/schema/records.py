"""Result records out: the OpenAI Batch output lines (docs/formats.md, "Result lines").

Every job ends in exactly one line, shaped as OpenAI's batch output shapes it:

- served: ``response.status_code`` 200 and a ``chat.completion`` / ``text_completion``
  body, a ``response`` one for ``/v1/responses`` jobs, or an embedding job's
  ``CreateEmbeddingResponse`` (``success_record``);
- a request error (``invalid_request``, ``context_length_exceeded``,
  ``duplicate_custom_id``): ``status_code`` 400 (``model_not_found``: 404) and
  ``body.error {message, type: "invalid_request_error", param, code}``, with
  ``"error": null``;
- an engine failure (``engine_error``): the same with 500 and ``"server_error"``;
- ``batch_expired`` / ``batch_cancelled``: ``"response": null`` and ``"error": {code,
  message}``.

``error_record`` / ``error_record_for`` pick the shape from the code, ``conflict_record``
builds the ``duplicate_custom_id`` line of a conflict; ``error_of`` and
``is_error_record`` read any line back. ``dumps`` serializes. orjson is imported here,
so the engine packages never import this.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from qworker.engine.outputs import RequestOutput
from qworker.errors import QworkerError
from qworker.schema.embeddings import embedding_body
from qworker.schema.jobs import Job, JobKind
from qworker.schema.response_body import response_body

#: Codes written as an ``invalid_request_error`` response (the request is at fault): 400
#: unless ``REQUEST_ERROR_STATUS`` says otherwise.
REQUEST_ERROR_CODES = frozenset(
    {"invalid_request", "context_length_exceeded", "duplicate_custom_id", "model_not_found"}
)
#: The HTTP status OpenAI answers these request errors with (docs/formats.md, "Error lines").
REQUEST_ERROR_STATUS = {"model_not_found": 404}
#: Codes written as ``"response": null`` with a top-level ``error`` (never reached the model).
BATCH_ERROR_CODES = frozenset({"batch_expired", "batch_cancelled"})
#: What OpenAI reports as a token's log-probability when it has none.
MISSING_LOGPROB = -9999.0
_PARAM = re.compile(r"^body\.([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*)")
_TOP_PARAM = re.compile(r"^(custom_id|batch_id|deadline|metadata|method|url|body)\b")


def new_id() -> str:
    """A fresh hex uuid4 for record / response ids."""
    return uuid.uuid4().hex


def new_request_id() -> str:
    """An OpenAI-shaped request id: ``req_<32 hex>``."""
    return f"req_{new_id()}"


def param_of(exc: BaseException) -> str | None:
    """The request field an error is about (OpenAI's ``param``), or None.

    An explicit ``exc.param`` wins; otherwise a message starting ``body.<field>...`` names
    ``<field>...`` and one starting with a top-level field (``url``, ``custom_id``, ...)
    names that field.
    """
    explicit = getattr(exc, "param", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    text = str(exc)
    match = _PARAM.match(text) or _TOP_PARAM.match(text)
    return match.group(1) if match else None


def error_record(
    custom_id: str,
    batch_id: str | None,
    code: str,
    message: str,
    metadata: dict[str, Any] | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The output line of a job that could not be served, shaped by ``code`` (see module).

    Request-error codes give a 400 response, ``batch_expired`` / ``batch_cancelled`` a
    top-level error, any other code (``engine_error``) a 500 ``server_error`` response.
    """
    record: dict[str, Any] = {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "batch_id": batch_id,
        "response": None,
        "error": None,
    }
    if code in BATCH_ERROR_CODES:
        record["error"] = {"code": code, "message": message}
    else:
        request = code in REQUEST_ERROR_CODES
        record["response"] = {
            "status_code": REQUEST_ERROR_STATUS.get(code, 400) if request else 500,
            "request_id": new_request_id(),
            "body": {"error": {
                "message": message,
                "type": "invalid_request_error" if request else "server_error",
                "param": param,
                "code": code,
            }},
        }
    if metadata is not None:
        record["metadata"] = metadata
    return record


def error_record_for(
    custom_id: str, batch_id: str | None, exc: BaseException, metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``error_record`` from an exception: QworkerError codes, anything else engine_error."""
    code = exc.code if isinstance(exc, QworkerError) else "engine_error"
    return error_record(
        custom_id, batch_id, code, str(exc) or type(exc).__name__, metadata, param_of(exc)
    )


def conflict_record(
    custom_id: str,
    batch_id: str | None,
    fingerprint: str,
    stored_fingerprint: str | None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``duplicate_custom_id`` line of a second, different request under one custom_id.

    ``fingerprint`` is this request's, ``stored_fingerprint`` the one whose result is
    stored (docs/formats.md, "Fingerprints and conflicts").
    """
    stored = stored_fingerprint or "unknown"
    message = (
        f"custom_id {custom_id!r} is used by two different requests in batch "
        f"{batch_id or 'default'!r}: the stored result answers request {stored[:12]}, "
        f"this request ({fingerprint[:12]}) was not served"
    )
    return error_record(custom_id, batch_id, "duplicate_custom_id", message, metadata, "custom_id")


def error_of(record: dict[str, Any]) -> dict[str, Any] | None:
    """``{"code", "message", "status_code", "param"}`` of a failed line; None for a success.

    Reads every shape of ``error_record`` (and the older ``"response": null`` lines).
    """
    error = record.get("error")
    if isinstance(error, dict):
        return {"code": error.get("code"), "message": error.get("message"),
                "status_code": None, "param": error.get("param")}
    response = record.get("response")
    if not isinstance(response, dict) or response.get("status_code") == 200:
        return None
    body = response.get("body")
    inner = body.get("error") if isinstance(body, dict) else None
    inner = inner if isinstance(inner, dict) else {}
    return {"code": inner.get("code"), "message": inner.get("message"),
            "status_code": response.get("status_code"), "param": inner.get("param")}


def is_error_record(record: dict[str, Any]) -> bool:
    """True unless the line is a served (status 200) response."""
    return error_of(record) is not None


def success_record(
    job: Job,
    output: RequestOutput,
    model: str,
    decode_token: Callable[[int], str] | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The output line of a served job: a chat.completion, text_completion or (responses
    jobs) response body, or an embedding job's ``CreateEmbeddingResponse``
    (``embeddings.embedding_body``).

    ``decode_token`` turns one token id into its text for logprobs (``token_id:N``
    without it). ``n > 1`` gives one choice per completion, by index.
    """
    hex_id = new_id()
    if job.kind is JobKind.EMBEDDING:
        return _served_line(job, hex_id, embedding_body(output, model, job.encoding_format,
                                                        len(job.inputs or ())))
    if job.kind is JobKind.RESPONSES:
        return _served_line(job, hex_id, response_body(job, output, model, hex_id, created))
    decode = decode_token or (lambda tid: f"token_id:{tid}")
    chat = job.kind is JobKind.CHAT
    choices = []
    for comp in sorted(output.outputs, key=lambda c: c.index):
        logprobs = None
        if job.want_logprobs and comp.logprobs is not None:
            logprobs = (_chat_logprobs if chat else _completion_logprobs)(
                comp.token_ids, comp.logprobs, job.top_logprobs, decode
            )
        choice: dict[str, Any] = {"index": comp.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": comp.text, "refusal": None}
        else:
            choice["text"] = comp.text
        choice["finish_reason"] = comp.finish_reason
        choice["logprobs"] = logprobs
        choices.append(choice)
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{hex_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        },
    }
    return _served_line(job, hex_id, body)


def _served_line(job: Job, hex_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The batch output line around a served job's ``body`` (``request_id`` from ``hex_id``)."""
    record: dict[str, Any] = {
        "id": f"batch_req_{new_id()}",
        "custom_id": job.custom_id,
        "batch_id": job.batch_id,
        "response": {"status_code": 200, "request_id": f"req_{hex_id}", "body": body},
        "error": None,
    }
    if job.metadata is not None:
        record["metadata"] = job.metadata
    return record


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return [(tid, _finite(lp)) for tid, lp in
            sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]]


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI writes -9999.0 for a token the model ruled out.
    return logprob if math.isfinite(logprob) else MISSING_LOGPROB


def _logprob(entry: dict[int, float], tid: int) -> float:
    return _finite(entry.get(tid, MISSING_LOGPROB))


def _chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], k: int, decode: Callable[[int], str]
) -> dict[str, Any]:
    content = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text = decode(tid)
        content.append(
            {
                "token": text,
                "logprob": _logprob(entry, tid),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": decode(alt),
                        "logprob": lp,
                        "bytes": list(decode(alt).encode("utf-8")),
                    }
                    for alt, lp in _top(entry, k)
                ],
            }
        )
    return {"content": content, "refusal": None}


def _completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], k: int, decode: Callable[[int], str]
) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text = decode(tid)
        tokens.append(text)
        token_logprobs.append(_logprob(entry, tid))
        tops.append({decode(alt): lp for alt, lp in _top(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def dumps(record: dict[str, Any]) -> bytes:
    """Serialize a record as one JSON line body (no trailing newline)."""
    return orjson.dumps(record)

