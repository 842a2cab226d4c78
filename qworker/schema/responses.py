"""``/v1/responses`` jobs in: OpenAI's Responses request as a chat job (docs/formats.md,
"Responses jobs").

``responses_job`` reads ``input`` (a string, or a list of message items with text
parts) and ``instructions`` into chat messages, ``max_output_tokens`` / ``temperature`` /
``top_p`` / ``seed`` (and the chat path's sampling extras) into ``SamplingParams``, and
``text.format`` into the same structured-output constraint ``response_format`` gives.
What the result's ``Response`` object echoes back (instructions, text, metadata, user,
...) is kept in ``Job.echo``. A field that would change the meaning and that qworker
cannot honour (tools, reasoning, previous_response_id, background, stream, include,
images and files, conversation, prompt templates, ...) is an ``invalid_request`` naming
it, never a silent ignore; so is a Chat Completions field in a Responses body (OpenAI
refuses unknown parameters), with the Responses name to use instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qworker.engine.sampling_params import SamplingParams
from qworker.errors import InvalidRequestError
from qworker.schema.jobs import Job, JobKind, _describe, _sampling, _short, job_model

# Fields of the Responses API that change the meaning of a request and that qworker
# cannot honour; each maps to a predicate telling whether the given value is harmless.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v in ("none", "auto"),  # with no tools: no call
    "reasoning": lambda v: v is None or v == {} or (
        isinstance(v, dict) and all(x is None for x in v.values())),
    "previous_response_id": lambda v: v is None,
    "background": lambda v: v is None or v is False,
    "stream": lambda v: v is None or v is False,
    "stream_options": lambda v: v is None,
    "include": lambda v: v is None or v == [],
    "conversation": lambda v: v is None,
    "prompt": lambda v: v is None,
    "max_tool_calls": lambda v: v is None,
    "top_logprobs": lambda v: v is None or v == 0,
    "truncation": lambda v: v is None or v == "disabled",
    "context_management": lambda v: v is None,
}
# Chat Completions fields a Responses body does not have, and what to use instead.
_CHAT_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
    "guided_json": "text.format",
    "guided_regex": None,
    "guided_choice": None,
    "n": None,
    "stop": None,
    "logprobs": None,
    "functions": None,
    "function_call": None,
    "logit_bias": None,
    "best_of": None,
    "echo": None,
    "suffix": None,
    "audio": None,
    "modalities": None,
    "reasoning_effort": "reasoning",
    "web_search_options": None,
}
#: Sampling fields read as the chat path reads them (OpenAI's and vLLM's extras).
_SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "min_tokens", "ignore_eos",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids")
_ROLES = ("user", "system", "developer", "assistant")
_FORMATS = ("text", "json_object", "json_schema")


def responses_job(custom_id: str, body: dict[str, Any], batch_id: str | None,
                  deadline: float | None, metadata: dict[str, Any] | None) -> Job:
    """The chat ``Job`` a Responses request body describes; ``InvalidRequestError`` naming
    the field when it is malformed or asks for what qworker cannot do."""
    for name, harmless in _UNSUPPORTED.items():
        if name in body and not harmless(body[name]):
            raise InvalidRequestError(
                f"body.{name}={_short(body[name])} is not supported by qworker")
    for name, instead in _CHAT_FIELDS.items():
        if name in body:
            hint = f" (use {instead})" if instead else ""
            raise InvalidRequestError(f"body.{name} is not a /v1/responses field{hint}")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError(
            f"body.instructions must be a string, got {_describe(instructions)}")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _input(body.get("input"))
    text = _text(body.get("text"))
    _bool(body, "store", True)  # accepted, without effect: results always go to the sink
    job = Job(custom_id=custom_id, kind=JobKind.RESPONSES, params=SamplingParams(),
              model=job_model(body), messages=messages, batch_id=batch_id,
              deadline=deadline, metadata=metadata)
    job.params = _params(body, text)
    job.echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": _metadata(body.get("metadata")),
        "parallel_tool_calls": _bool(body, "parallel_tool_calls", True),
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "truncation": "disabled",
        "user": _string(body, "user"),
    }
    return job


def _input(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(
            f"body.input must be a string or a non-empty list of messages, got "
            f"{_describe(value)}")
    return [_message(item, f"body.input[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where} must be a message object, got {_describe(item)}")
    kind = item.get("type", "message")
    if kind != "message":
        raise InvalidRequestError(
            f"{where}.type {_describe(kind)} is not supported by qworker (only message "
            "items: tool calls, reasoning and item references are not)")
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidRequestError(
            f"{where}.role must be one of {', '.join(_ROLES)}, got {_describe(role)}")
    return {"role": "system" if role == "developer" else role,
            "content": _content(item.get("content"), where, role)}


def _content(value: Any, where: str, role: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(
            f"{where}.content must be a string or a list of text parts, got "
            f"{_describe(value)}")
    allowed = ("input_text", "output_text") if role == "assistant" else ("input_text",)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            shown = _describe(kind) if isinstance(part, dict) else _describe(part)
            raise InvalidRequestError(
                f"{where}.content[{j}] must be an {' or '.join(allowed)} part, got {shown} "
                "(only text is supported)")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _text(value: Any) -> dict[str, Any]:
    """``body.text`` as the Response echoes it: ``{"format": {...}}`` (+ ``verbosity``)."""
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"body.text must be an object, got {_describe(value)}")
    fmt = value.get("format")
    if fmt is None:
        fmt = {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        shown = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise InvalidRequestError(
            f"body.text.format.type must be one of {', '.join(_FORMATS)}, got "
            f"{_describe(shown)}")
    if fmt["type"] == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                f"body.text.format.name must be a non-empty string, got {_describe(name)}")
        if fmt.get("description") is not None and not isinstance(fmt["description"], str):
            raise InvalidRequestError("body.text.format.description must be a string")
    # Echoed as OpenAI echoes it: the format's own fields only.
    keys = ("type", "name", "schema", "description", "strict") if fmt["type"] == "json_schema" \
        else ("type",)
    out: dict[str, Any] = {"format": {k: fmt[k] for k in keys if k in fmt}}
    verbosity = value.get("verbosity")
    if verbosity is not None:
        if verbosity not in ("low", "medium", "high"):
            raise InvalidRequestError(
                f"body.text.verbosity must be low, medium or high, got {_describe(verbosity)}")
        out["verbosity"] = verbosity
    return out


def _params(body: dict[str, Any], text: dict[str, Any]) -> SamplingParams:
    """Sampling as the chat path reads it, with errors naming the Responses fields."""
    max_output = body.get("max_output_tokens")
    if max_output is not None and (not isinstance(max_output, int) or isinstance(
            max_output, bool) or max_output < 1):
        raise InvalidRequestError(
            f"body.max_output_tokens must be an integer >= 1, got {_describe(max_output)}")
    chat_body: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    chat_body["max_tokens"] = max_output
    fmt = text["format"]
    if fmt["type"] != "text":
        rf: dict[str, Any] = {"type": fmt["type"]}
        if fmt["type"] == "json_schema":
            rf["json_schema"] = {k: fmt.get(k) for k in ("name", "schema", "strict")}
        chat_body["response_format"] = rf
    try:
        params, _, _ = _sampling(chat_body, JobKind.CHAT)
    except InvalidRequestError as exc:
        raise InvalidRequestError(_renamed(str(exc))) from None
    spec = params.structured_outputs
    if spec is not None:  # compile errors name the field the user wrote
        spec.where = _renamed(spec.where)
    return params


def _renamed(text: str) -> str:
    """A chat-path message or field path in the Responses request's own names."""
    for chat, own in (("body.response_format.json_schema.schema", "body.text.format.schema"),
                      ("body.response_format.json_schema", "body.text.format"),
                      ("body.response_format", "body.text.format"),
                      ("body.max_tokens", "body.max_output_tokens")):
        if text.startswith(chat):
            return own + text[len(chat):]
    return text


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"body.metadata must be an object, got {_describe(value)}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise InvalidRequestError(
                f"body.metadata.{key} must be a string, got {_describe(item)}")
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"body.{name} must be a boolean, got {_describe(value)}")
    return value


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"body.{name} must be a string, got {_describe(value)}")
    return value
