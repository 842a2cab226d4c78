"""Job messages in: parse and validate one raw message into a ``Job`` (docs/formats.md, "Jobs").

``parse_job`` turns one raw message into a ``ParsedJob``: a valid ``Job``, an
``invalid_request`` error to record under the job's custom_id, or a dead-letter
reason when the message is not even a JSON object with a usable custom_id.
orjson is imported here, so the engine packages never import this.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidRequestError
from qworker.schema.depth import MAX_JOB_DEPTH, deep_field
from qworker.schema.fingerprint import raw_fingerprint, request_fingerprint
from qworker.schema.peek import PeekedIds, peek_ids
from qworker.schema.structured import structured_outputs

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
RESPONSES_URL = "/v1/responses"
EMBEDDINGS_URL = "/v1/embeddings"
MAX_N = 128
MAX_METADATA_DEPTH = 32
#: Values (at any depth) in a job's ``metadata``: it is copied into every record, and
#: serializing a JSON array costs the encoder ~300 bytes per item for a moment.
MAX_METADATA_VALUES = 1024
# Caps that keep one request from costing the worker out of proportion (docs/formats.md):
MAX_CUSTOM_ID_BYTES = 4096
MAX_STOP_STRINGS = 16  # every stop string is checked against every generated token
MAX_STOP_CHARS = 256
#: n x max_tokens x (top_logprobs + 1): ~80 bytes each in the result line (~8 MB here).
MAX_LOGPROB_ENTRIES = 100_000
_ROLES = {"system", "developer", "user", "assistant"}

# Body fields that change the meaning of a request and that qworker cannot honour:
# each maps to a predicate telling whether the given value is harmless (a default).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v is None or v == "none",
    "stream": lambda v: v is None or v is False,
    "logit_bias": lambda v: v is None or v == {},
    "best_of": lambda v: v is None or v == 1,
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "use_beam_search": lambda v: v is None or v is False,
    "guided_grammar": lambda v: v is None,
}


class JobKind(Enum):
    """Which endpoint a job addresses."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    RESPONSES = "responses"  # a chat job answered with a Response object (schema/responses.py)


@dataclass(slots=True)
class Job:
    """A validated job: what to generate and how to answer it.

    Exactly one of ``messages`` (chat, responses), ``prompt`` (completion) and ``inputs``
    (embedding: its ``encoding_format`` and ``dimensions`` beside it; ``params`` unused)
    is set. ``top_logprobs`` is the number of alternatives per token to report when
    ``want_logprobs``; ``deadline`` is unix seconds. ``model`` is ``body.model`` as
    given (None when absent), checked against what the worker serves when prepared.
    """

    custom_id: str
    kind: JobKind
    params: SamplingParams
    model: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    batch_id: str | None = None
    deadline: float | None = None
    metadata: dict[str, Any] | None = None
    want_logprobs: bool = False
    top_logprobs: int = 0
    inputs: list[str | list[int]] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    #: Responses jobs: the request fields their ``Response`` object echoes back.
    echo: dict[str, Any] | None = None


@dataclass(slots=True)
class ParsedJob:
    """The outcome of ``parse_job``: exactly one of ``job``, ``error``, ``dead_letter``.

    ``custom_id`` / ``batch_id`` are set whenever they could be read, so an ``error``
    can be recorded under the right key; so is ``fingerprint``, the request's
    ``request_fingerprint`` (stored with its result).
    """

    job: Job | None = None
    error: Exception | None = None
    dead_letter: str | None = None
    custom_id: str | None = None
    batch_id: str | None = None
    fingerprint: str | None = None


def parse_job(body: bytes, max_job_bytes: int = 1 << 20, size: int | None = None,
              ids: PeekedIds | None = None) -> ParsedJob:
    """Parse and validate one raw job message (never raises).

    ``size`` is the message's full size when ``body`` holds only its head (a spool line
    read in part), ``ids`` what a scan of the whole message found. Over
    ``max_job_bytes``: never parsed; an ``invalid_request`` error when its custom_id
    (and batch) can be read without parsing (``peek_ids``), else a dead letter. Not
    JSON, not UTF-8, not an object, or no string ``custom_id``: dead letter. Nested
    deeper than ``MAX_JOB_DEPTH`` or any invalid field: an ``invalid_request`` error
    naming the field. Any other failure while validating is the job's error too (a
    ``server_error`` line), never an exception.
    """
    size = len(body) if size is None else size
    if size > max_job_bytes:
        return _oversized(body, size, max_job_bytes, ids)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return _undecodable(body, exc)
    if not isinstance(data, dict):
        return ParsedJob(dead_letter=f"job must be a JSON object, got {_json_type(data)}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return ParsedJob(
            dead_letter=f"custom_id must be a non-empty string, got {_describe(custom_id)}"
        )
    batch_id = data.get("batch_id")
    parsed = ParsedJob(custom_id=custom_id,
                       batch_id=batch_id if isinstance(batch_id, str) else None)
    too_deep = deep_field(data, MAX_JOB_DEPTH)
    parsed.fingerprint = request_fingerprint(data.get("url"), data.get("body"), raw=body)
    if too_deep is not None:
        limit = MAX_METADATA_DEPTH if too_deep == "metadata" else MAX_JOB_DEPTH
        parsed.error = InvalidRequestError(f"{too_deep} is nested deeper than {limit} levels")
        return parsed
    id_bytes = len(custom_id.encode("utf-8", "surrogatepass"))
    if id_bytes > MAX_CUSTOM_ID_BYTES:
        parsed.error = InvalidRequestError(
            f"custom_id is {id_bytes} bytes, over the limit of {MAX_CUSTOM_ID_BYTES} bytes"
        )
        return parsed
    try:
        parsed.job = _validate(data, custom_id)
    except InvalidRequestError as exc:
        parsed.error = exc
    except RecursionError:  # a value too deep for a validator (the bound above is generous)
        parsed.error = InvalidRequestError("body is nested too deeply to validate")
    except Exception as exc:  # a validator's own failure: the job's server_error, not a crash
        parsed.error = exc
    return parsed


def _oversized(body: bytes, size: int, max_job_bytes: int,
               ids: PeekedIds | None) -> ParsedJob:
    """A message over the limit: answered under its ids when they can be read unparsed."""
    reason = f"job is {size} bytes, over the limit of {max_job_bytes} bytes (max_job_bytes)"
    ids = ids if ids is not None else peek_ids(body)
    if ids.custom_id is None or not ids.batch_known or \
            len(ids.custom_id.encode("utf-8")) > MAX_CUSTOM_ID_BYTES:
        return ParsedJob(dead_letter=f"{reason}; its custom_id could not be read without "
                         "parsing it")
    return ParsedJob(custom_id=ids.custom_id, batch_id=ids.batch_id,
                     error=InvalidRequestError(reason), fingerprint=raw_fingerprint(body, size))


def _undecodable(body: bytes, exc: orjson.JSONDecodeError) -> ParsedJob:
    """Not JSON qworker can read; valid JSON with an out-of-range number or a lone
    surrogate (RFC 8259 allows both) still gets its error line under its custom_id."""
    reason = f"not valid JSON: {exc}"
    if "infinity" not in str(exc) and "surrogate" not in str(exc):
        return ParsedJob(dead_letter=reason)
    ids = peek_ids(body)
    if ids.custom_id is None or not ids.batch_known:
        return ParsedJob(dead_letter=reason)
    return ParsedJob(custom_id=ids.custom_id, batch_id=ids.batch_id,
                     error=InvalidRequestError(f"job is {reason}"),
                     fingerprint=raw_fingerprint(body, len(body)))


def _validate(data: dict[str, Any], custom_id: str) -> Job:
    batch_id = data.get("batch_id")
    if batch_id is not None and (not isinstance(batch_id, str) or not batch_id):
        raise InvalidRequestError(f"batch_id must be a non-empty string, got {_describe(batch_id)}")
    deadline = data.get("deadline")
    if deadline is not None and not _is_number(deadline):
        raise InvalidRequestError(
            f"deadline must be unix seconds (a number), got {_describe(deadline)}"
        )
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequestError(f"metadata must be an object, got {_describe(metadata)}")
    if metadata is not None and _depth(metadata) > MAX_METADATA_DEPTH:
        raise InvalidRequestError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
    if metadata is not None and _more_values_than(metadata, MAX_METADATA_VALUES):
        raise InvalidRequestError(f"metadata holds more than {MAX_METADATA_VALUES} values")
    method = data.get("method", "POST")
    if method != "POST":
        raise InvalidRequestError(f'method must be "POST", got {_describe(method)}')
    url = data.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL, EMBEDDINGS_URL):
        raise InvalidRequestError(
            f"url must be {CHAT_URL}, {COMPLETIONS_URL}, {RESPONSES_URL} or {EMBEDDINGS_URL}, "
            f"got {_describe(url)}"
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise InvalidRequestError(f"body must be an object, got {_describe(body)}")
    deadline_s = float(deadline) if deadline is not None else None
    if url == RESPONSES_URL:  # its own fields and refusals (docs/formats.md, "Responses jobs")
        from qworker.schema.responses import responses_job

        return responses_job(custom_id, body, batch_id, deadline_s, metadata)
    for name, harmless in _UNSUPPORTED.items():
        if url != EMBEDDINGS_URL and name in body and not harmless(body[name]):
            raise InvalidRequestError(
                f"body.{name}={_short(body[name])} is not supported by qworker"
            )
    kind = {CHAT_URL: JobKind.CHAT, EMBEDDINGS_URL: JobKind.EMBEDDING}.get(url,
                                                                          JobKind.COMPLETION)
    job = Job(
        custom_id=custom_id,
        kind=kind,
        params=SamplingParams(),
        model=job_model(body),
        batch_id=batch_id,
        deadline=deadline_s,
        metadata=metadata,
    )
    if kind is JobKind.EMBEDDING:
        from qworker.schema.embeddings import embedding_fields  # it imports this module

        job.inputs, job.encoding_format, job.dimensions = embedding_fields(body)
        return job
    if kind is JobKind.CHAT:
        job.messages = _messages(body.get("messages"))
    else:
        job.prompt = _prompt(body.get("prompt"))
    job.params, job.want_logprobs, job.top_logprobs = _sampling(body, kind)
    return job


def job_model(body: dict[str, Any]) -> str | None:
    """``body.model``: a non-empty string, or None when the body has none (every job kind)."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequestError(f"body.model must be a non-empty string, got {_describe(model)}")
    return model


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"body.messages must be a non-empty list, got {_describe(value)}")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{where} must be an object, got {_describe(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {sorted(_ROLES)}, got {_describe(role)}"
            )
        if msg.get("tool_calls"):
            raise InvalidRequestError(f"{where}.tool_calls is not supported by qworker")
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(msg.get("content"), where),
            }
        )
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of text parts, got {_describe(value)}"
        )
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else _describe(part)
            raise InvalidRequestError(
                f"{where}.content[{j}] must be a text part, got type {_describe(kind)} "
                "(only text is supported)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("body.prompt must not be empty")
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        if any(t < 0 for t in value):
            raise InvalidRequestError("body.prompt token ids must be >= 0")
        return value
    raise InvalidRequestError(
        f"body.prompt must be a non-empty string or list of token ids, got {_describe(value)}"
    )


def _sampling(body: dict[str, Any], kind: JobKind) -> tuple[SamplingParams, bool, int]:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None and kind is JobKind.COMPLETION:
        max_tokens = 16  # the OpenAI completions default
    want, top = _logprobs(body, kind)
    fields: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": top if want else None}
    for name in (
        "temperature",
        "top_p",
        "n",
        "seed",
        "stop",
        "top_k",
        "min_p",
        "ignore_eos",
        "repetition_penalty",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
    ):
        value = body.get(name)
        if value is not None:
            fields[name] = value
    _check_stop(fields.get("stop"))
    fields["structured_outputs"] = structured_outputs(body)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if name in fields and not _is_number(fields[name]):
            raise InvalidRequestError(
                f"body.{name} must be a number, got {_describe(fields[name])}"
            )
    n, seed = fields.get("n"), fields.get("seed")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise InvalidRequestError(f"body.n must be at most {MAX_N}, got {n}")
    if isinstance(seed, int) and not isinstance(seed, bool) and not -(2**63) <= seed < 2**63:
        raise InvalidRequestError(f"body.seed must fit in a signed 64-bit integer, got {seed}")
    try:
        params = SamplingParams(**fields)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"body.{exc}") from None
    if params.temperature > 2.0:
        raise InvalidRequestError(f"body.temperature must be <= 2, got {params.temperature!r}")
    if want and params.max_tokens is not None:
        too_many = logprob_volume_error(params.n, params.max_tokens, top)
        if too_many is not None:
            raise too_many
    return params, want, top


def _check_stop(value: Any) -> None:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return  # SamplingParams names the type error
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"body.stop has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for i, item in enumerate(items):
        if isinstance(item, str) and len(item) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"body.stop[{i}] is {len(item)} characters; at most {MAX_STOP_CHARS} are allowed"
            )


def logprob_volume_error(n: int, max_tokens: int, top_logprobs: int) -> InvalidRequestError | None:
    """The error of a request whose logprobs would exceed ``MAX_LOGPROB_ENTRIES``, or None."""
    entries = n * max_tokens * (top_logprobs + 1)
    if entries <= MAX_LOGPROB_ENTRIES:
        return None
    return InvalidRequestError(
        f"body.top_logprobs: the request would return {entries} log-probabilities "
        f"(n x max_tokens x (top_logprobs + 1)), over the limit of {MAX_LOGPROB_ENTRIES}; "
        "lower max_tokens, n or top_logprobs"
    )


def _logprobs(body: dict[str, Any], kind: JobKind) -> tuple[bool, int]:
    value = body.get("logprobs")
    if kind is JobKind.CHAT:
        if value is not None and not isinstance(value, bool):
            raise InvalidRequestError(f"body.logprobs must be a boolean, got {_describe(value)}")
        top = body.get("top_logprobs")
        if top is None:
            return bool(value), 0
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
            raise InvalidRequestError(
                f"body.top_logprobs must be an integer in 0..20, got {_describe(top)}"
            )
        if not value:
            raise InvalidRequestError("body.top_logprobs requires body.logprobs to be true")
        return True, top
    if value is None:
        return False, 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 20:
        raise InvalidRequestError(
            f"body.logprobs must be an integer in 0..20, got {_describe(value)}"
        )
    return True, value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value (iterative: the value may be very deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend(
                (child, level + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


def _more_values_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether ``value`` holds more than ``limit`` values at any depth (iterative; stops
    counting as soon as it knows)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += len(item)
        if count > limit:
            return True
        stack.extend(child for child in (item.values() if isinstance(item, dict) else item)
                     if isinstance(child, dict | list))
    return False


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return _short(value)
    return f"{_json_type(value)} {_short(value)}"


def _short(value: Any) -> str:
    """At most 60 characters of ``value``'s JSON, from a preview of its first values: the
    whole value may be a 100,000-item array (serializing it costs ~300 bytes an item)."""
    budget = [_PREVIEW_VALUES]
    try:
        text = orjson.dumps(_preview(value, budget), option=orjson.OPT_NON_STR_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError):
        text = f"<{_json_type(value)} too deeply nested>"
    return text if len(text) <= 60 else text[:57] + "..."


#: Values a preview keeps: each is at least 2 characters of JSON, so a cut preview is
#: always longer than the 60 characters shown (and shown with "...").
_PREVIEW_VALUES = 40


def _preview(value: Any, budget: list[int]) -> Any:
    """``value`` with only its first ``budget[0]`` values at any depth (depth-first)."""
    if not isinstance(value, dict | list) or budget[0] <= 0:
        return value if not isinstance(value, dict | list) else type(value)()
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for key, child in value.items():
            if budget[0] <= 0:
                break
            budget[0] -= 1
            out[key] = _preview(child, budget)
        return out
    items = []
    for child in value:
        if budget[0] <= 0:
            break
        budget[0] -= 1
        items.append(_preview(child, budget))
    return items
