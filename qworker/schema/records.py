"""Result records out: the OpenAI Batch output lines of DESIGN.md.

``success_record`` / ``error_record`` build the output line of one job; ``dumps``
serializes it. orjson is imported here, so the engine packages never import this.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from qworker.engine.outputs import RequestOutput
from qworker.errors import QworkerError
from qworker.schema.jobs import Job, JobKind


def new_id() -> str:
    """A fresh hex uuid4 for record / response ids."""
    return uuid.uuid4().hex


def error_record(
    custom_id: str,
    batch_id: str | None,
    code: str,
    message: str,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The output line of a job that could not be served (``response`` null)."""
    record: dict[str, Any] = {
        "id": f"batch_req_{new_id()}",
        "custom_id": custom_id,
        "batch_id": batch_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    if metadata is not None:
        record["metadata"] = metadata
    return record


def error_record_for(
    custom_id: str, batch_id: str | None, exc: BaseException, metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``error_record`` from an exception: QworkerError codes, anything else engine_error."""
    code = exc.code if isinstance(exc, QworkerError) else "engine_error"
    return error_record(custom_id, batch_id, code, str(exc) or type(exc).__name__, metadata)


def success_record(
    job: Job,
    output: RequestOutput,
    model: str,
    decode_token: Callable[[int], str] | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The output line of a served job: a chat.completion or text_completion body.

    ``decode_token`` turns one token id into its text for logprobs (``token_id:N``
    without it). ``n > 1`` gives one choice per completion, by index.
    """
    decode = decode_token or (lambda tid: f"token_id:{tid}")
    request_id = new_id()
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
            choice["message"] = {"role": "assistant", "content": comp.text}
        else:
            choice["text"] = comp.text
        choice["finish_reason"] = comp.finish_reason
        choice["logprobs"] = logprobs
        choices.append(choice)
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    record: dict[str, Any] = {
        "id": f"batch_req_{new_id()}",
        "custom_id": job.custom_id,
        "batch_id": job.batch_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }
    if job.metadata is not None:
        record["metadata"] = job.metadata
    return record


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], k: int, decode: Callable[[int], str]
) -> dict[str, Any]:
    content = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text = decode(tid)
        content.append(
            {
                "token": text,
                "logprob": entry.get(tid, -math.inf),
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
    return {"content": content}


def _completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], k: int, decode: Callable[[int], str]
) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text = decode(tid)
        tokens.append(text)
        token_logprobs.append(entry.get(tid, -math.inf))
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

