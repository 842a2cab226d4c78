"""Request fingerprints: canonical whatever the message's size, in bounded memory."""

from __future__ import annotations

import tracemalloc

import orjson

from qworker.schema.fingerprint import STREAM_ABOVE_BYTES, request_fingerprint


def _job(n: int) -> tuple[dict, bytes]:
    body = {"prompt": list(range(1000, 1000 + n)), "temperature": 0.5, "stop": ["\n", "é"],
            "max_tokens": 16, "logprobs": None, "echo": False}
    return body, orjson.dumps({"url": "/v1/completions", "body": body})


def test_a_large_message_has_the_fingerprint_its_canonical_json_gives() -> None:
    body, raw = _job(60_000)
    assert len(raw) > STREAM_ABOVE_BYTES
    import hashlib

    canonical = orjson.dumps({"body": body, "url": "/v1/completions"},
                             option=orjson.OPT_SORT_KEYS)
    assert request_fingerprint("/v1/completions", body, raw) == \
        hashlib.sha256(canonical).hexdigest()
    # the same request written with other whitespace is the same request
    assert request_fingerprint("/v1/completions", body, raw + b" " * 10) == \
        request_fingerprint("/v1/completions", body, raw[:100])


def test_a_long_token_id_prompt_is_fingerprinted_in_bounded_memory() -> None:
    body = {"prompt": list(range(300_000)), "max_tokens": 16}
    raw = b" " * (STREAM_ABOVE_BYTES + 1)  # only its size decides how it is hashed
    tracemalloc.start()
    try:
        request_fingerprint("/v1/completions", body, raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # orjson.dumps would reserve ~86 MB here
