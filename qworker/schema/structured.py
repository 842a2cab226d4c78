"""A job body's structured-output fields into ``StructuredOutputsParams``.

Accepted (``docs/structured_outputs.md``): OpenAI's ``response_format`` —
``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``, or
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
— and vLLM's ``structured_outputs`` object (``json`` / ``json_object`` / ``regex`` /
``choice``) with its older spellings ``guided_json``, ``guided_regex``,
``guided_choice``. At most one of them per job. Only the shape is checked here; the
engine compiles the grammar when the job is submitted (an invalid or unsupported
schema is then that job's ``invalid_request``). A schema given as JSON text is parsed
here, with the same depth bound as the job itself (``qworker.schema.depth``), so no
recursive parser or compiler ever meets a schema deeper than that.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from qworker.engine.structured.params import StructuredOutputsParams
from qworker.errors import InvalidRequestError
from qworker.schema.depth import MAX_JOB_DEPTH, nesting_depth

#: Body fields that carry a structured-output constraint.
FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice")
_RESPONSE_TYPES = ("text", "json_object", "json_schema")
_SPEC_KEYS = ("json", "json_object", "regex", "choice")


def structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint a job body asks for, or None; ``InvalidRequestError`` naming the
    field when it is malformed or when several fields ask for one."""
    specs = []
    for name in FIELDS:
        value = body.get(name)
        if value is None:
            continue
        spec = _parse(name, value)
        if spec is not None:
            specs.append((name, spec))
    if len(specs) > 1:
        names = ", ".join(f"body.{n}" for n, _ in specs)
        raise InvalidRequestError(f"give at most one structured output constraint, got {names}")
    return specs[0][1] if specs else None


def _parse(name: str, value: Any) -> StructuredOutputsParams | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"body.structured_outputs must be an object, got {_kind(value)}")
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"body.structured_outputs.{unknown[0]} is not supported by qworker "
                f"(supported: {', '.join(_SPEC_KEYS)})")
        fields = {k: v for k, v in value.items() if v is not None}
        if "json" in fields:
            fields["json"] = _json_text(fields["json"], "body.structured_outputs.json")
        return _build(fields, "body.structured_outputs")
    key = name.removeprefix("guided_")
    if key == "json":
        value = _json_text(value, f"body.{name}")
    return _build({key: value}, f"body.{name}", exact=True)


def _json_text(value: Any, where: str) -> Any:
    """A schema given as JSON text, parsed (depth-bounded); any other value unchanged."""
    if not isinstance(value, str):
        return value
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc).lower():
            raise InvalidRequestError(
                f"{where} is nested deeper than {MAX_JOB_DEPTH} levels") from None
        raise InvalidRequestError(f"{where} is not valid JSON: {exc}") from None
    if nesting_depth(parsed, stop_above=MAX_JOB_DEPTH) > MAX_JOB_DEPTH:
        raise InvalidRequestError(f"{where} is nested deeper than {MAX_JOB_DEPTH} levels")
    return parsed


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value == "text":
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"body.response_format must be an object with a type, got {_kind(value)}")
    kind = value.get("type")
    if kind not in _RESPONSE_TYPES:
        raise InvalidRequestError(
            f"body.response_format.type must be one of {', '.join(_RESPONSE_TYPES)}, "
            f"got {_kind(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        spec = StructuredOutputsParams(json_object=True)
        spec.where = "body.response_format"
        return spec
    where = "body.response_format.json_schema"
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidRequestError(f"{where} must be an object, got {_kind(js)}")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError(f"{where}.name must be a string, got {_kind(name)}")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict must be a boolean, got {_kind(strict)}")
    schema = js.get("schema")
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(f"{where}.schema must be a JSON schema object, "
                                  f"got {_kind(schema)}")
    # strict or not, qworker always constrains generation to the schema
    return _build({"json": schema}, f"{where}.schema", exact=True)


def _build(fields: dict[str, Any], where: str, exact: bool = False) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields)`` with errors naming ``where``.

    ``exact``: ``where`` names the one value given (``body.guided_json``), so errors say
    ``<where> ...``; otherwise ``<where>.<field> ...``.
    """
    try:
        spec = StructuredOutputsParams(**fields)
    except InvalidRequestError as exc:
        message = str(exc)
        for key in _SPEC_KEYS:
            prefix = f"structured_outputs.{key}"
            if message.startswith(prefix + " ") or message.startswith(prefix + "."):
                target = where if exact else f"{where}.{key}"
                raise InvalidRequestError(target + message[len(prefix):]) from None
        raise InvalidRequestError(f"{where}: {message.removeprefix('structured_outputs ')}"
                                  ) from None
    spec.where = where if exact else f"{where}.{spec.kind}"
    return spec


def _kind(value: Any) -> str:
    """A short JSON rendering of ``value`` for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."
