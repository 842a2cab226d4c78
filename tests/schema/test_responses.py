"""``/v1/responses`` jobs: parsed as chat jobs, answered with OpenAI's ``Response`` object.

qworker/schema/responses.py (the request) and response_body.py (the result body);
every body is validated with the openai SDK's ``Response`` type (tests/schema/openai_types.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from qworker.engine.outputs import CompletionOutput, RequestOutput
from qworker.schema import JobKind, parse_job, success_record
from qworker.schema.records import error_record_for
from tests.schema.openai_types import validate_line

pytest.importorskip("openai")

from openai.types.responses import Response


def _line(**body: Any) -> bytes:
    return json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/responses",
                       "body": {"model": "m", **body}}).encode()


def _job(**body: Any) -> Any:
    parsed = parse_job(_line(**body))
    assert parsed.error is None, parsed.error
    assert parsed.job is not None
    return parsed.job


def _error(**body: Any) -> tuple[str, str | None, dict[str, Any]]:
    parsed = parse_job(_line(**body))
    assert parsed.job is None and parsed.error is not None
    record = error_record_for("r1", None, parsed.error)
    assert validate_line(record) == "400"
    inner = record["response"]["body"]["error"]
    return inner["message"], inner["param"], record


def _served(job: Any, text: str = "Paris.", finish: str = "stop", tokens: int = 3,
            cached: int = 0) -> dict[str, Any]:
    out = RequestOutput("q", None, [1, 2, 3, 4, 5], [
        CompletionOutput(0, text, list(range(tokens)), finish_reason=finish)], True,
        num_cached_tokens=cached)
    record = success_record(job, out, "SmolLM2-135M-Instruct", created=1764460000)
    assert validate_line(record) == "response"
    return record


def test_a_string_input_is_one_user_message_and_instructions_come_first() -> None:
    job = _job(input="What is the capital of France?", instructions="Answer in one word.",
               max_output_tokens=5, temperature=0, top_p=0.9, seed=7)
    assert job.kind is JobKind.RESPONSES and job.model == "m"
    assert job.messages == [{"role": "system", "content": "Answer in one word."},
                            {"role": "user", "content": "What is the capital of France?"}]
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.n) == (5, 0.0, 0.9, 7, 1)


def test_message_items_with_text_parts_become_chat_messages() -> None:
    job = _job(input=[
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "again"},
    ])
    assert job.messages == [{"role": "system", "content": "Be terse."},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": "ok"},
                            {"role": "user", "content": "again"}]
    assert job.params.max_tokens is None  # like OpenAI: bounded by the context only


def test_text_format_maps_to_the_structured_outputs_response_format_gives() -> None:
    assert _job(input="x").params.structured_outputs is None
    assert _job(input="x", text={"format": {"type": "text"}}).params.structured_outputs is None
    spec = _job(input="x", text={"format": {"type": "json_object"}}).params.structured_outputs
    assert spec is not None and spec.json_object
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    spec = _job(input="x", text={"format": {"type": "json_schema", "name": "answer",
                                            "schema": schema, "strict": True}}
                ).params.structured_outputs
    assert spec is not None and spec.json == schema
    assert spec.where == "body.text.format.schema"  # compile errors name the Responses field
    echoed = _job(input="x", text={"format": {"type": "json_object", "extra": 1},
                                   "verbosity": "low"}).echo["text"]
    assert echoed == {"format": {"type": "json_object"}, "verbosity": "low"}


def test_harmless_defaults_and_ignored_fields_are_accepted() -> None:
    job = _job(input="x", store=False, truncation="disabled", tools=[], tool_choice="auto",
               parallel_tool_calls=True, reasoning=None, background=False, stream=False,
               include=[], metadata={"k": "v"}, user="u1", service_tier="auto",
               prompt_cache_key="p", safety_identifier="s", top_logprobs=0)
    assert job.echo["metadata"] == {"k": "v"} and job.echo["user"] == "u1"
    _job(input="x", store=True, tool_choice="none")


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "name": "f", "parameters": {}}]),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "name": "f"}),
    ("reasoning", {"effort": "high"}),
    ("previous_response_id", "resp_123"),
    ("background", True),
    ("stream", True),
    ("include", ["message.output_text.logprobs"]),
    ("conversation", "conv_1"),
    ("prompt", {"id": "pmpt_1"}),
    ("max_tool_calls", 3),
    ("truncation", "auto"),
    ("top_logprobs", 2),
])
def test_fields_that_change_the_meaning_are_refused_by_name(field: str, value: Any) -> None:
    message, param, _ = _error(input="x", **{field: value})
    assert message.startswith(f"body.{field}=") and "not supported by qworker" in message
    assert param == field


@pytest.mark.parametrize(("field", "instead"), [
    ("messages", "input"), ("max_tokens", "max_output_tokens"), ("n", None),
    ("response_format", "text.format"), ("stop", None), ("logprobs", None),
])
def test_chat_fields_in_a_responses_body_are_refused_with_the_name_to_use(
    field: str, instead: str | None
) -> None:
    message, param, _ = _error(input="x", **{field: 2})
    assert message.startswith(f"body.{field} is not a /v1/responses field")
    assert param == field
    if instead:
        assert f"(use {instead})" in message


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({}, "input", "body.input must be a string or a non-empty list"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[0].type", "only message items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]", "only text is supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]", "only text is supported"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0]", "must be an input_text part"),
    ({"input": "x", "instructions": 3}, "instructions", "must be a string"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "integer >= 1"),
    ({"input": "x", "temperature": 3}, "temperature", "<= 2"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "one of"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name", "non-empty string"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 3}}},
     "text.format.schema", "JSON schema object"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k", "must be a string"),
    ({"input": "x", "store": "yes"}, "store", "must be a boolean"),
    ({"input": "x", "model": ""}, "model", "non-empty string"),
])
def test_malformed_fields_are_invalid_request_naming_them(
    body: dict[str, Any], param: str, needle: str
) -> None:
    parsed = parse_job(json.dumps({"custom_id": "r1", "url": "/v1/responses",
                                   "body": body}).encode())
    assert parsed.error is not None, parsed.job
    record = error_record_for("r1", None, parsed.error)
    assert validate_line(record) == "400"
    inner = record["response"]["body"]["error"]
    assert inner["param"] == param, inner
    assert needle in inner["message"], inner["message"]


def test_a_served_job_is_a_completed_response_object() -> None:
    job = _job(input="Capital of France?", instructions="One word.", max_output_tokens=16,
               temperature=0, metadata={"team": "geo"}, user="u1",
               text={"format": {"type": "json_object"}})
    record = _served(job, cached=2)
    assert record["response"]["status_code"] == 200
    body = record["response"]["body"]
    resp = Response.model_validate(body)
    assert resp.id == "resp_" + record["response"]["request_id"].removeprefix("req_")
    assert len(resp.id) == len("resp_") + 32
    assert (resp.object, resp.status, resp.model, resp.created_at) == (
        "response", "completed", "SmolLM2-135M-Instruct", 1764460000)
    assert resp.incomplete_details is None and resp.error is None
    assert resp.output_text == "Paris."
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": "Paris.", "annotations": []}]
    assert body["usage"] == {"input_tokens": 5,
                             "input_tokens_details": {"cached_tokens": 2,
                                                      "cache_write_tokens": 0},
                             "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 8}
    assert (body["instructions"], body["max_output_tokens"], body["temperature"],
            body["top_p"], body["metadata"], body["user"]) == (
        "One word.", 16, 0.0, 1.0, {"team": "geo"}, "u1")
    assert (body["tools"], body["tool_choice"], body["parallel_tool_calls"]) == (
        [], "auto", True)
    assert body["text"] == {"format": {"type": "json_object"}}


def test_a_job_cut_by_length_is_incomplete_for_max_output_tokens() -> None:
    job = _job(input="Tell me a story", max_output_tokens=3)
    body = _served(job, text="Once upon a", finish="length")["response"]["body"]
    resp = Response.model_validate(body)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert body["output"][0]["status"] == "incomplete"
    assert body["text"] == {"format": {"type": "text"}} and body["metadata"] == {}


def test_the_line_keeps_the_batch_fields_of_the_job() -> None:
    line = json.dumps({"custom_id": "r9", "url": "/v1/responses", "batch_id": "b1",
                       "metadata": {"src": "x"}, "body": {"input": "hi"}}).encode()
    job = parse_job(line).job
    assert job is not None
    record = _served(job)
    assert (record["custom_id"], record["batch_id"], record["metadata"]) == (
        "r9", "b1", {"src": "x"})


def test_formats_md_lists_exactly_the_responses_fields_that_are_refused() -> None:
    import re
    from pathlib import Path

    from qworker.schema.responses import _UNSUPPORTED

    text = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    start = text.index("### Responses jobs")
    paragraph = text[text.index("...):", start) + 5:text.index("; input items other", start)]
    assert set(re.findall(r"`(\w+)`", paragraph)) == set(_UNSUPPORTED)
