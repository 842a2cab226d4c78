"""Job bodies' structured-output fields, penalties and min_tokens (qworker/schema)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("orjson")

from qworker.schema import parse_job

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _body(url: str = "/v1/chat/completions", **fields: Any) -> bytes:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **fields}
    if url == "/v1/completions":
        body = {"prompt": "hi", **fields}
    return json.dumps({"custom_id": "c1", "url": url, "body": body}).encode()


@pytest.mark.parametrize(
    ("fields", "kind", "key_text", "where"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "", "body.response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}},
         "json", json.dumps(SCHEMA, separators=(",", ":")),
         "body.response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+",
         "body.structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["yes", "no"], "json": None}}, "choice",
         '["yes", "no"]', "body.structured_outputs.choice"),
        ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA, separators=(",", ":")),
         "body.guided_json"),
        ({"guided_regex": "x+"}, "regex", "x+", "body.guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", '["a", "b"]', "body.guided_choice"),
    ],
)
def test_structured_output_fields_become_the_job_constraint(fields: dict, kind: str,
                                                            key_text: str, where: str) -> None:
    for url in ("/v1/chat/completions", "/v1/completions"):
        parsed = parse_job(_body(url, **fields))
        assert parsed.error is None and parsed.job is not None, parsed.error
        spec = parsed.job.params.structured_outputs
        assert spec is not None and spec.key == (kind, key_text) and spec.label == where


def test_text_and_absent_formats_leave_generation_free_and_penalties_map() -> None:
    for fields in ({}, {"response_format": {"type": "text"}}, {"response_format": "text"},
                   {"response_format": None}):
        job = parse_job(_body(**fields)).job
        assert job is not None and job.params.structured_outputs is None
    job = parse_job(_body(presence_penalty=0.5, frequency_penalty=-1, min_tokens=3)).job
    assert job is not None
    p = job.params
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens) == (0.5, -1, 3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": "json"},
         'body.response_format must be an object with a type, got "json"'),
        ({"response_format": {"type": "json_schema"}},
         "body.response_format.json_schema must be an object, got null"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "body.response_format.json_schema.schema must be a JSON schema object, got null"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
         "body.response_format.json_schema.schema must be a JSON schema object, got [1]"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
         'body.response_format.json_schema.strict must be a boolean, got "yes"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                     "name": 5}}},
         "body.response_format.json_schema.name must be a string, got 5"),
        ({"structured_outputs": {"grammar": "start: x"}},
         "body.structured_outputs.grammar is not supported by qworker"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "body.structured_outputs: needs exactly one of json, json_object, regex, choice"),
        ({"structured_outputs": "json"}, 'body.structured_outputs must be an object, got "json"'),
        ({"guided_json": "{oops"}, "body.guided_json is not valid JSON"),
        ({"guided_choice": []}, "body.guided_choice must be a non-empty list"),
        ({"guided_regex": 5}, "body.guided_regex must be a non-empty string, got 5"),
        ({"guided_grammar": "start: x"}, 'body.guided_grammar="start: x" is not supported'),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
         "give at most one structured output constraint, got body.response_format, "
         "body.guided_regex"),
        ({"min_tokens": 50, "max_tokens": 10},
         "body.min_tokens must be <= max_tokens (10), got 50"),
    ],
)
def test_malformed_structured_fields_are_invalid_requests_naming_them(fields: dict,
                                                                      message: str) -> None:
    parsed = parse_job(_body(**fields))
    assert parsed.job is None and parsed.error is not None and parsed.custom_id == "c1"
    assert parsed.error.code == "invalid_request"
    assert str(parsed.error).startswith(message), str(parsed.error)
