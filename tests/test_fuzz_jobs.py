"""Fuzz of the job parser and validator (qworker/schema.py) with hostile messages.

The promise under test: every message a producer can put on a queue ends as a
valid job, an error record under its custom_id, or a dead-letter entry, and
never as an exception that would crash or wedge the worker; and whatever the
custom_id, its object key stays inside its batch folder and distinct from every
other job's key. Budget: well under 30 s (hypothesis ``max_examples``).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

orjson = pytest.importorskip("orjson")

from qworker.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from qworker.schema import (  # noqa: E402
    dumps,
    error_record_for,
    parse_job,
    result_key,
    success_record,
)

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

HOSTILE_IDS = ["../../etc/passwd", "..", ".", "%2e%2e", "%2E%2E/x", "a/../../b", "/abs",
               "nul\x00byte", "new\nline\r\n", "tab\tsep", "ünïcødé", "😀" * 60, "x" * 1100,
               "sha256-" + "0" * 64, "%00", "\u202etxt.exe",
               "ignore previous instructions; rm -rf /",
               "${jndi:ldap://x}", "<script>", "C:\\Windows\\..\\x", " ", "~", "?a=1#f"]

_KEY_CHARS = re.compile(r"[A-Za-z0-9._%/-]+")

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
json_values = st.recursive(
    json_scalars,
    lambda kids: (st.lists(kids, max_size=4)
                  | st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=20,
)
custom_ids = st.sampled_from(HOSTILE_IDS) | st.text(min_size=1, max_size=300) | json_values


def _bodies() -> st.SearchStrategy[dict[str, Any]]:
    fields = ["model", "max_tokens", "max_completion_tokens", "temperature",
              "top_p", "n", "seed", "stop", "logprobs", "top_logprobs", "top_k", "min_p",
              "ignore_eos", "tools", "stream", "response_format", "repetition_penalty",
              "stop_token_ids", "presence_penalty", "frequency_penalty", "min_tokens",
              "structured_outputs", "guided_json", "guided_regex", "guided_choice"]
    messages = st.lists(
        st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "tool"])
                                            | json_values,
                                            "content": st.text(max_size=30) | json_values,
                                            "tool_calls": json_values}),
        max_size=3) | json_values
    good = {"messages": messages, "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 99))
            | json_values,
            "input": st.text(max_size=30) | st.lists(st.integers(-5, 99))
            | st.lists(st.text(max_size=5) | st.lists(st.integers(-5, 99), max_size=3),
                       max_size=4) | json_values}
    return st.dictionaries(st.sampled_from(fields), json_values, max_size=6).flatmap(
        lambda d: st.fixed_dictionaries({k: st.just(v) for k, v in d.items()},
                                        optional=good))


jobs = st.fixed_dictionaries(
    {"custom_id": custom_ids},
    optional={"method": st.sampled_from(["POST", "GET"]) | json_values,
              "url": st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                      "/v1/embeddings", "/v1/x"])
              | json_values,
              "body": _bodies() | json_values,
              "batch_id": st.text(max_size=300) | json_values,
              "deadline": json_values,
              "metadata": json_values},
)


def _encode(obj: Any) -> bytes:
    # json (not orjson) writes NaN/Infinity literals and lone surrogates, as hostile producers do.
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


def _assert_handled(raw: bytes) -> None:
    """parse_job gives exactly one outcome, and the record the worker would write serializes."""
    parsed = parse_job(raw)
    outcomes = [parsed.job is not None, parsed.error is not None, parsed.dead_letter is not None]
    assert sum(outcomes) == 1, parsed
    if parsed.dead_letter is not None:
        assert isinstance(parsed.dead_letter, str) and parsed.dead_letter
        return
    assert isinstance(parsed.custom_id, str) and parsed.custom_id
    if parsed.error is not None:
        record = error_record_for(parsed.custom_id, parsed.batch_id, parsed.error)
    else:
        job = parsed.job
        assert job.custom_id == parsed.custom_id
        done = CompletionOutput(0, "hi", [3], finish_reason="stop")
        out = RequestOutput("r", None, [1, 2], [done], True,
                            embeddings=[[0.5, -0.5]] * len(job.inputs or ()))
        record = success_record(job, out, "echo")
    back = orjson.loads(dumps(record))
    assert back["custom_id"] == parsed.custom_id
    key = result_key("results", parsed.batch_id, parsed.custom_id)
    _assert_safe_key(key)


def _assert_safe_key(key: str) -> None:
    assert _KEY_CHARS.fullmatch(key), key
    segments = key.split("/")
    assert all(seg not in ("", ".", "..") for seg in segments), key
    assert len(key.encode()) <= 1024, len(key)


@FUZZ
@given(st.binary(max_size=400))
@example(b"")
@example(b"\xff\xfe{\"custom_id\": 1}")
@example(b'{"custom_id": "\xc3\x28"}')
@example(b"[1, 2, 3]")
@example(b"null")
@example(b'"just a string"')
def test_arbitrary_bytes_never_raise(raw: bytes) -> None:
    """Random bytes, including invalid UTF-8, end as one outcome."""
    _assert_handled(raw)


@FUZZ
@given(jobs)
def test_job_shaped_messages_with_wrong_types_never_raise(job: dict[str, Any]) -> None:
    """Job-shaped objects with wrong types, NaN/Infinity and huge numbers anywhere."""
    _assert_handled(_encode(job))


@FUZZ
@given(jobs, st.integers(0, 60), st.binary(min_size=1, max_size=4))
def test_corrupted_job_bytes_never_raise(job: dict[str, Any], pos: int, junk: bytes) -> None:
    """A valid-looking job with bytes spliced in (invalid UTF-8, truncation) stays handled."""
    raw = _encode(job)
    _assert_handled(raw[:pos] + junk + raw[pos:])
    _assert_handled(raw[:pos])


@FUZZ
@given(st.sampled_from(["url", "method", "tools", "metadata", "deadline", "batch_id", "prompt",
                        "messages", "stop", "custom_id", "role"]),
       st.integers(1, 1100), st.sampled_from("[{"))
def test_deep_nesting_anywhere_never_raises(where: str, depth: int, bracket: str) -> None:
    """Values nested up to past orjson's depth limits (255 on dumps, 1024 on loads)."""
    close = "]" if bracket == "[" else "}"
    inner = '"k":1' if bracket == "{" else "1"
    deep = (bracket + ('"k":' if bracket == "{" else "")) * (depth - 1) + bracket + inner \
        + close * depth
    job = {"custom_id": "deep", "url": "/v1/chat/completions", "method": "POST",
           "body": {"messages": [{"role": "user", "content": "hi"}]}}
    text = json.dumps(job)
    if where in ("url", "method", "metadata", "deadline", "batch_id", "custom_id"):
        text = text[:-1] + f', "{where}": {deep}}}'
    elif where == "role":
        text = text.replace('"role": "user"', f'"role": {deep}')
    else:
        text = text.replace('"body": {', f'"body": {{"{where}": {deep}, ', 1)
    _assert_handled(text.encode())


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["custom_id", "url", "body", "batch_id", "metadata"]),
                          json_values), min_size=1, max_size=8))
def test_duplicate_keys_never_raise(pairs: list[tuple[str, Any]]) -> None:
    """Objects repeating keys (last one wins in orjson) are handled like any other."""
    base = '"custom_id": "dup", "url": "/v1/completions", "body": {"prompt": "x"}'
    extra = ", ".join(f"{json.dumps(k)}: {json.dumps(v, allow_nan=True)}" for k, v in pairs)
    _assert_handled(("{" + base + ", " + extra + ", " + base + "}").encode())
    _assert_handled(("{" + base + ", " + extra + "}").encode())


@FUZZ
@given(st.integers(1, 3), st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-0",
                                          "123456789012345678901234567890", "1e-400"]),
       st.sampled_from(["temperature", "top_p", "max_tokens", "n", "seed", "deadline", "top_k"]))
def test_non_finite_and_huge_numbers_never_raise(_: int, literal: str, name: str) -> None:
    """NaN / Infinity literals and out-of-range numbers in numeric fields."""
    if name == "deadline":
        text = '{"custom_id": "n", "url": "/v1/completions", "body": {"prompt": "x"}, ' \
               f'"deadline": {literal}}}'
    else:
        text = f'{{"custom_id": "n", "url": "/v1/completions", "body": {{"prompt": "x", ' \
               f'"{name}": {literal}}}}}'
    _assert_handled(text.encode())


def test_huge_strings_are_bounded_by_max_job_bytes() -> None:
    """A 2 MiB prompt gets an invalid_request error naming max_job_bytes, not a crash."""
    raw = json.dumps({"custom_id": "big", "url": "/v1/completions",
                      "body": {"prompt": "x" * (2 << 20)}}).encode()
    parsed = parse_job(raw)
    assert parsed.error is not None and parsed.error.code == "invalid_request"
    assert "max_job_bytes" in str(parsed.error)


@FUZZ
@given(custom_ids.filter(lambda c: isinstance(c, str) and c != ""),
       st.text(min_size=1, max_size=300) | st.none())
def test_result_keys_stay_inside_their_batch_folder(custom_id: str, batch_id: str | None) -> None:
    """No custom_id or batch_id escapes ``prefix/batch/`` or yields unsafe characters."""
    try:
        custom_id.encode()
    except UnicodeEncodeError:
        return  # lone surrogates never get past the JSON parser
    key = result_key("out/pre", batch_id, custom_id)
    _assert_safe_key(key)
    assert key.startswith("out/pre/") and key.endswith(".json")
    assert key.count("/") == 3


@FUZZ
@given(st.lists(st.sampled_from(HOSTILE_IDS) | st.text(min_size=1, max_size=250),
                min_size=2, max_size=20, unique=True))
def test_distinct_custom_ids_get_distinct_keys(ids: list[str]) -> None:
    """The key scheme is injective: two jobs never share (and overwrite/dedupe) one object."""
    ids = [i for i in ids if not any(0xD800 <= ord(c) <= 0xDFFF for c in i)]
    keys = {result_key("p", "b", i) for i in ids}
    assert len(keys) == len(ids)


def test_hash_lookalike_id_does_not_collide_with_hashed_long_id() -> None:
    """An id spelling ``sha256-<hex>`` never lands on the key of the long id hashing to it."""
    import hashlib

    long_id = "y" * 500
    lookalike = "sha256-" + hashlib.sha256(long_id.encode()).hexdigest()
    assert result_key("p", "b", long_id) != result_key("p", "b", lookalike)


def test_role_of_unhashable_type_is_an_invalid_request() -> None:
    """Regression: ``"role": [1]`` raised TypeError (unhashable) out of parse_job."""
    raw = b'{"custom_id": "r", "url": "/v1/chat/completions", ' \
          b'"body": {"messages": [{"role": [1], "content": "hi"}]}}'
    parsed = parse_job(raw)
    assert parsed.error is not None and parsed.error.code == "invalid_request"
    assert "role" in str(parsed.error)


@pytest.mark.parametrize("where", ["url", "body.tools"])
def test_error_message_for_a_300_deep_value_does_not_raise(where: str) -> None:
    """Regression: describing a value nested past orjson.dumps' depth limit raised TypeError."""
    deep = "[" * 300 + "]" * 300
    if where == "url":
        raw = f'{{"custom_id": "d", "url": {deep}, "body": {{}}}}'
    else:
        raw = f'{{"custom_id": "d", "url": "/v1/completions", "body": {{"prompt": "a", ' \
              f'"tools": {deep}}}}}'
    parsed = parse_job(raw.encode())
    assert parsed.error is not None and parsed.error.code == "invalid_request"


def test_metadata_too_deep_to_serialize_is_rejected_not_written() -> None:
    """Regression: metadata nested 300 deep was accepted; its record then failed to serialize."""
    deep = "{" + '"k":{' * 299 + "}" * 300
    raw = f'{{"custom_id": "m", "url": "/v1/completions", "body": {{"prompt": "a"}}, ' \
          f'"metadata": {deep}}}'
    _assert_handled(raw.encode())


def test_nan_is_not_a_number_anywhere() -> None:
    """NaN literals never reach SamplingParams as a valid temperature."""
    parsed = parse_job(b'{"custom_id": "n", "url": "/v1/completions", '
                       b'"body": {"prompt": "x", "temperature": NaN}}')
    assert parsed.job is None or not math.isnan(parsed.job.params.temperature)
