"""Job parsing and validation, result records and object keys (qworker/schema.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

orjson = pytest.importorskip("orjson")

from qworker.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from qworker.schema import (  # noqa: E402
    JobKind,
    conflict_key,
    conflict_record,
    error_of,
    error_record,
    error_record_for,
    is_error_record,
    manifest_key,
    param_of,
    parse_job,
    result_key,
    safe_segment,
    success_record,
)


def _job(body: dict[str, Any] | None = None, url: str = "/v1/chat/completions",
         **top: Any) -> bytes:
    if body is None:
        body = {"messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body,
                       **top}).encode()


def _chat(**fields: Any) -> bytes:
    return _job({"messages": [{"role": "user", "content": "hi"}], **fields})


# ------------------------------------------------------------------ dead letters


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json at all", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[1, 2]", "job must be a JSON object, got an array"),
        (b'"text"', "job must be a JSON object, got a string"),
        (b"null", "job must be a JSON object, got null"),
        (b'{"url": "/v1/completions"}', "custom_id must be a non-empty string, got null"),
        (b'{"custom_id": 7}', "custom_id must be a non-empty string, got a number 7"),
        (b'{"custom_id": ""}', "custom_id must be a non-empty string"),
    ],
)
def test_message_that_is_not_a_job_object_is_dead_lettered(raw: bytes, reason: str) -> None:
    parsed = parse_job(raw)
    assert parsed.job is None and parsed.error is None
    assert parsed.dead_letter is not None and parsed.dead_letter.startswith(reason)


# ------------------------------------------------------------------ invalid requests


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_job(url="/v1/images/generations"),
         "url must be /v1/chat/completions, /v1/completions, /v1/responses or /v1/embeddings, "
         'got "/v1/images/generations"'),
        (_job(method="GET"), 'method must be "POST", got "GET"'),
        (_job(body=[1]), "body must be an object, got an array [1]"),
        (_job({"messages": []}), "body.messages must be a non-empty list, got an array []"),
        (_job({"messages": "hi"}), 'body.messages must be a non-empty list, got "hi"'),
        (_job({"messages": [{"role": "robot", "content": "x"}]}),
         "body.messages[0].role must be one of ['assistant', 'developer', 'system', 'user'], "
         'got "robot"'),
        (_job({"messages": [{"role": "user", "content": 5}]}),
         "body.messages[0].content must be a string or a list of text parts, got a number 5"),
        (_job({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
         'body.messages[0].content[0] must be a text part, got type "image_url" '
         "(only text is supported)"),
        (_job({"prompt": ""}, url="/v1/completions"), "body.prompt must not be empty"),
        (_job({"prompt": ["a", "b"]}, url="/v1/completions"),
         'body.prompt must be a non-empty string or list of token ids, got an array ["a","b"]'),
        (_job({"prompt": [1, -2]}, url="/v1/completions"), "body.prompt token ids must be >= 0"),
        (_chat(max_tokens="5"), "body.max_tokens must be an integer >= 1 or None, got '5'"),
        (_chat(max_tokens=0), "body.max_tokens must be an integer >= 1 or None, got 0"),
        (_chat(max_completion_tokens=-1),
         "body.max_tokens must be an integer >= 1 or None, got -1"),
        (_chat(temperature=-0.5), "body.temperature must be a finite number >= 0, got -0.5"),
        (_chat(temperature="hot"), 'body.temperature must be a number, got "hot"'),
        (_chat(temperature=3), "body.temperature must be <= 2, got 3"),
        (_chat(top_p=0), "body.top_p must be in (0, 1], got 0"),
        (_chat(n=0), "body.n must be an integer >= 1, got 0"),
        (_chat(n=1000), "body.n must be at most 128, got 1000"),
        (_chat(seed=1.5), "body.seed must be an integer or None, got 1.5"),
        (_chat(stop=[1]), "body.stop must be a string or a list of strings, got [1]"),
        (_chat(logprobs=3), "body.logprobs must be a boolean, got a number 3"),
        (_chat(top_logprobs=2), "body.top_logprobs requires body.logprobs to be true"),
        (_chat(logprobs=True, top_logprobs=50),
         "body.top_logprobs must be an integer in 0..20, got a number 50"),
        (_chat(presence_penalty=2.5), "body.presence_penalty must be a number in [-2, 2], got 2.5"),
        (_chat(frequency_penalty="lots"), 'body.frequency_penalty must be a number, got "lots"'),
        (_chat(min_tokens=-3), "body.min_tokens must be an integer >= 0, got -3"),
        (_chat(response_format={"type": "xml"}),
         'body.response_format.type must be one of text, json_object, json_schema, got "xml"'),
        (_chat(tools=[{"type": "function"}]),
         'body.tools=[{"type":"function"}] is not supported by qworker'),
        (_chat(stream=True), "body.stream=true is not supported by qworker"),
        (_chat(logit_bias={"50": 5}), 'body.logit_bias={"50":5} is not supported by qworker'),
        (_job({"prompt": "x", "echo": True}, url="/v1/completions"),
         "body.echo=true is not supported by qworker"),
        (_job({"prompt": "x", "best_of": 3}, url="/v1/completions"),
         "body.best_of=3 is not supported by qworker"),
        (_chat(), None),  # control: valid
        (_job(batch_id=5), "batch_id must be a non-empty string, got a number 5"),
        (_job(deadline="tomorrow"), 'deadline must be unix seconds (a number), got "tomorrow"'),
        (_job(metadata=[1]), "metadata must be an object, got an array [1]"),
        (_job(metadata={"ids": list(range(1025))}), "metadata holds more than 1024 values"),
        (_job(metadata={"a": [{"b": list(range(500))}, list(range(600))]}),
         "metadata holds more than 1024 values"),
    ],
)
def test_invalid_job_gets_invalid_request_naming_the_field(raw: bytes, message: str | None) -> None:
    parsed = parse_job(raw)
    assert parsed.dead_letter is None
    if message is None:
        assert parsed.job is not None and parsed.error is None
        return
    assert parsed.job is None and parsed.error is not None
    assert parsed.error.code == "invalid_request"
    assert str(parsed.error) == message
    assert parsed.custom_id == "c1"


def test_oversized_job_is_invalid_request_under_its_custom_id() -> None:
    raw = _chat(messages=[{"role": "user", "content": "x" * 5000}])
    parsed = parse_job(raw, max_job_bytes=1000)
    assert parsed.custom_id == "c1" and parsed.error is not None
    assert str(parsed.error) == (
        f"job is {len(raw)} bytes, over the limit of 1000 bytes (max_job_bytes)"
    )


def test_harmless_defaults_and_unknown_fields_are_accepted() -> None:
    parsed = parse_job(_chat(stream=False, tools=[], tool_choice="none", presence_penalty=0,
                             response_format={"type": "text"}, user="u1", store=False,
                             some_future_field={"x": 1}, model="gpt-4o"))
    assert parsed.job is not None


def test_body_fields_map_to_sampling_params() -> None:
    parsed = parse_job(_chat(max_completion_tokens=9, max_tokens=3, temperature=0, top_p=0.5,
                             n=2, seed=7, stop=["\n"], top_k=5, min_p=0.1, ignore_eos=True,
                             repetition_penalty=1.2, logprobs=True, top_logprobs=3))
    job = parsed.job
    assert job is not None and job.kind is JobKind.CHAT
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed) == (9, 0, 0.5, 2, 7)
    assert (p.stop_strings, p.top_k, p.min_p, p.ignore_eos, p.repetition_penalty) == (
        ["\n"], 5, 0.1, True, 1.2)
    assert p.logprobs == 3 and job.want_logprobs and job.top_logprobs == 3


def test_completion_defaults_to_16_tokens_and_chat_to_no_limit() -> None:
    comp = parse_job(_job({"prompt": [1, 2, 3]}, url="/v1/completions")).job
    chat = parse_job(_chat()).job
    assert comp is not None and comp.prompt == [1, 2, 3] and comp.params.max_tokens == 16
    assert chat is not None and chat.params.max_tokens is None


def test_text_parts_are_joined_and_developer_role_becomes_system() -> None:
    parsed = parse_job(_job({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]}))
    assert parsed.job is not None
    assert parsed.job.messages == [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "a\nb"}]


def test_metadata_of_1024_values_is_carried() -> None:
    metadata = {"ids": list(range(1000)), "tags": {str(i): i for i in range(22)}}
    parsed = parse_job(_job(metadata=metadata))
    assert parsed.job is not None and parsed.job.metadata == metadata


def test_batch_id_deadline_metadata_are_carried() -> None:
    parsed = parse_job(_job(batch_id="night", deadline=1764460800, metadata={"k": "v"}))
    job = parsed.job
    assert job is not None
    assert (job.batch_id, job.deadline, job.metadata) == ("night", 1764460800.0, {"k": "v"})


# ------------------------------------------------------------------ records


def _output(n: int = 1, logprobs: bool = False) -> RequestOutput:
    comps = [CompletionOutput(i, f"text{i}", [5, 6], -1.0,
                              [{5: -0.1, 9: -2.5}, {6: -0.2, 9: -1.9}] if logprobs else None,
                              "stop" if i == 0 else "length") for i in range(n)]
    return RequestOutput("rid", None, [1, 2, 3], comps, True)


def test_chat_success_record_has_the_openai_batch_shape() -> None:
    job = parse_job(_chat(n=2, seed=1)).job
    assert job is not None
    record = success_record(job, _output(2), "smol", created=123)
    assert set(record) == {"id", "custom_id", "batch_id", "response", "error"}
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", record["id"])
    assert record["custom_id"] == "c1" and record["error"] is None
    resp = record["response"]
    assert resp["status_code"] == 200
    body = resp["body"]
    assert re.fullmatch(r"req_[0-9a-f]{32}", resp["request_id"])
    assert body["id"] == f"chatcmpl-{resp['request_id'].removeprefix('req_')}"
    assert (body["object"], body["created"], body["model"]) == ("chat.completion", 123, "smol")
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "text0", "refusal": None},
         "finish_reason": "stop", "logprobs": None},
        {"index": 1, "message": {"role": "assistant", "content": "text1", "refusal": None},
         "finish_reason": "length", "logprobs": None},
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_record_with_logprobs_has_openai_legacy_shape() -> None:
    job = parse_job(_job({"prompt": "x", "logprobs": 1}, url="/v1/completions")).job
    assert job is not None
    body = success_record(job, _output(1, logprobs=True), "m", lambda t: f"<{t}>")["response"][
        "body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == "text0"
    assert choice["logprobs"] == {"tokens": ["<5>", "<6>"], "token_logprobs": [-0.1, -0.2],
                                  "top_logprobs": [{"<5>": -0.1}, {"<6>": -0.2}],
                                  "text_offset": [0, 3]}


def test_chat_logprobs_list_chosen_token_and_top_alternatives() -> None:
    job = parse_job(_chat(logprobs=True, top_logprobs=2)).job
    assert job is not None
    lp = success_record(job, _output(1, logprobs=True), "m", lambda t: f"t{t}")["response"][
        "body"]["choices"][0]["logprobs"]
    first = lp["content"][0]
    assert first["token"] == "t5" and first["logprob"] == -0.1 and first["bytes"] == [116, 53]
    assert [a["token"] for a in first["top_logprobs"]] == ["t5", "t9"]


def test_expired_record_has_null_response_and_code() -> None:
    record = error_record("c", None, "batch_expired", "too late")
    assert record["response"] is None and record["batch_id"] is None
    assert record["error"] == {"code": "batch_expired", "message": "too late"}


def test_request_errors_are_400_responses_naming_the_param() -> None:
    parsed = parse_job(_chat(temperature=-1))
    assert parsed.error is not None
    record = error_record_for("c1", None, parsed.error)
    assert record["error"] is None
    response = record["response"]
    assert response["status_code"] == 400
    assert re.fullmatch(r"req_[0-9a-f]{32}", response["request_id"])
    assert response["body"] == {"error": {
        "message": str(parsed.error), "type": "invalid_request_error",
        "param": "temperature", "code": "invalid_request"}}
    assert error_of(record) == {"code": "invalid_request", "message": str(parsed.error),
                                "status_code": 400, "param": "temperature"}


def test_engine_failures_are_500_server_errors() -> None:
    record = error_record_for("c1", "b", RuntimeError("device-side assert"))
    assert record["response"]["status_code"] == 500
    assert record["response"]["body"]["error"] == {
        "message": "device-side assert", "type": "server_error", "param": None,
        "code": "engine_error"}
    assert is_error_record(record) and error_of(record)["code"] == "engine_error"


def test_conflict_record_names_both_fingerprints() -> None:
    record = conflict_record("doc-1", "night", "a" * 64, "b" * 64, {"k": 1})
    error = error_of(record)
    assert error is not None and error["code"] == "duplicate_custom_id"
    assert error["status_code"] == 400 and error["param"] == "custom_id"
    assert "aaaaaaaaaaaa" in error["message"] and "bbbbbbbbbbbb" in error["message"]
    assert record["metadata"] == {"k": 1}


@pytest.mark.parametrize(
    ("message", "param"),
    [("body.messages[0].role must be one of", "messages[0].role"),
     ("body.response_format.type is bad", "response_format.type"),
     ("url must be /v1/chat/completions", "url"), ("prompt is 100 tokens", None)],
)
def test_param_comes_from_the_field_the_message_names(message: str, param: str | None) -> None:
    assert param_of(ValueError(message)) == param


# ------------------------------------------------------------------ keys


def test_result_key_layout() -> None:
    assert result_key("pre/fix/", "night", "doc-1") == "pre/fix/night/doc-1.json"
    assert result_key("", None, "doc-1") == "default/doc-1.json"
    assert manifest_key("pre", "night") == "pre/night/_manifest.json"
    assert (conflict_key("pre", "night", "a/b", "f" * 64)
            == "pre/night/_conflicts/a%2Fb-ffffffffffff.json")
    # no custom_id can land on qworker's own names
    assert result_key("pre", "night", "_manifest") != manifest_key("pre", "night")


@pytest.mark.parametrize(
    ("custom_id", "segment"),
    [("a/b", "a%2Fb"), ("..", "%2E%2E"), (".", "%2E"), ("é", "%C3%A9"), ("a b", "a%20b"),
     ("100%", "100%25"), ("sha256-x", "%73ha256-x"), ("_manifest", "%5Fmanifest"),
     ("a_b", "a_b")],
)
def test_unsafe_characters_are_percent_encoded(custom_id: str, segment: str) -> None:
    assert safe_segment(custom_id) == segment


def test_long_ids_fall_back_to_sha256() -> None:
    key = safe_segment("k" * 1024)
    assert re.fullmatch(r"sha256-[0-9a-f]{64}", key)
    assert safe_segment("k" * 200) == "k" * 200
    assert safe_segment("é" * 100).startswith("sha256-")  # 600 encoded bytes


_ids = st.text(min_size=1, max_size=300) | st.sampled_from(
    ["..", ".", "/", "../etc", "a/../b", "x" * 1024, "日本語/テキスト", "%2F", "a%2Fb"])


@settings(max_examples=200, deadline=None)
@given(st.lists(_ids, min_size=2, max_size=10, unique=True), st.none() | _ids)
def test_custom_ids_map_to_safe_distinct_keys(ids: list[str], batch_id: str | None) -> None:
    ids = [i for i in ids if not any(0xD800 <= ord(c) <= 0xDFFF for c in i)]
    keys = [result_key("p", batch_id, i) for i in ids]
    assert len(set(keys)) == len(keys)
    for key in keys:
        parts = key.split("/")
        assert len(parts) == 3 and parts[0] == "p"
        assert all(part not in ("", ".", "..") for part in parts)
        assert re.fullmatch(r"[A-Za-z0-9._%-]+", parts[1] + parts[2])
        assert not parts[1].startswith("_") and not parts[2].startswith("_")
        assert len(parts[2].encode()) <= 205
