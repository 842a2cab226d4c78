"""Request fingerprints: which request a stored result answers (docs/formats.md).

``request_fingerprint`` is the sha256 of the canonical JSON of a job's ``url`` and
``body`` (keys sorted, no whitespace). Two messages with one custom_id and equal
fingerprints are the same request delivered twice; different fingerprints are two
requests sharing a custom_id (a ``duplicate_custom_id`` conflict). ``batch_id``,
``deadline`` and ``metadata`` do not take part: they do not change the answer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson


def request_fingerprint(url: Any, body: Any) -> str:
    """64 hex digits identifying the request ``{"url": url, "body": body}``."""
    value = {"body": body, "url": url}
    try:
        canonical = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # nested past orjson's 254 levels
        try:
            canonical = json.dumps(value, sort_keys=True, separators=(",", ":"),
                                   ensure_ascii=False, allow_nan=False).encode()
        except (RecursionError, TypeError, ValueError):
            canonical = repr(value).encode("utf-8", "replace")
    return hashlib.sha256(canonical).hexdigest()
