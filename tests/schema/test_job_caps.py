"""Caps on what one request may cost (qworker/schema/jobs.py): each a clear invalid_request."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("orjson")

from qworker.schema import error_of, error_record_for, parse_job
from qworker.schema.jobs import (
    MAX_CUSTOM_ID_BYTES,
    MAX_LOGPROB_ENTRIES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
)


def _job(custom_id: str = "c1", **body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body}}).encode()


def _error(body: bytes) -> dict:
    parsed = parse_job(body)
    assert parsed.job is None and parsed.error is not None and parsed.dead_letter is None
    record = error_record_for(parsed.custom_id or "", parsed.batch_id, parsed.error)
    error = error_of(record)
    assert error is not None and error["code"] == "invalid_request"
    return error


def test_too_many_stop_strings_are_refused() -> None:
    assert parse_job(_job(stop=["x"] * MAX_STOP_STRINGS)).job is not None
    error = _error(_job(stop=["x"] * (MAX_STOP_STRINGS + 1)))
    assert f"at most {MAX_STOP_STRINGS}" in error["message"] and error["param"] == "stop"


def test_an_overlong_stop_string_is_refused() -> None:
    assert parse_job(_job(stop="y" * MAX_STOP_CHARS)).job is not None
    error = _error(_job(stop=["ok", "y" * (MAX_STOP_CHARS + 1)]))
    assert error["message"].startswith("body.stop[1] is") and error["param"] == "stop[1]"


def test_an_overlong_custom_id_is_refused_under_its_own_id() -> None:
    assert parse_job(_job("é" * (MAX_CUSTOM_ID_BYTES // 2))).job is not None
    long_id = "é" * (MAX_CUSTOM_ID_BYTES // 2 + 1)
    parsed = parse_job(_job(long_id))
    assert parsed.custom_id == long_id and parsed.error is not None
    assert f"over the limit of {MAX_CUSTOM_ID_BYTES} bytes" in str(parsed.error)


def test_logprob_volume_is_capped_by_n_max_tokens_and_top_logprobs() -> None:
    fits = MAX_LOGPROB_ENTRIES // 21
    assert parse_job(_job(logprobs=True, top_logprobs=20, max_tokens=fits)).job is not None
    error = _error(_job(logprobs=True, top_logprobs=20, max_tokens=fits, n=2))
    assert "log-probabilities" in error["message"] and error["param"] == "top_logprobs"
    # Without logprobs the same size is fine.
    assert parse_job(_job(max_tokens=fits, n=2)).job is not None
