"""Request fingerprints: which request a stored result answers (docs/formats.md).

``request_fingerprint`` is the sha256 of the canonical JSON of a job's ``url`` and
``body`` (keys sorted, no whitespace). Two messages with one custom_id and equal
fingerprints are the same request delivered twice; different fingerprints are two
requests sharing a custom_id (a ``duplicate_custom_id`` conflict). ``batch_id``,
``deadline`` and ``metadata`` do not take part: they do not change the answer.

A request that has no canonical form (nested past what a serializer takes, or never
parsed because it is over ``max_job_bytes``) is fingerprinted by its raw bytes
(``raw_fingerprint``): a redelivery has the same bytes. A message over 64 KiB is
canonicalized by the standard library's encoder, chunk by chunk into the hash (same bytes,
bounded memory). Neither function raises.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson


def request_fingerprint(url: Any, body: Any, raw: bytes | None = None) -> str:
    """64 hex digits identifying the request ``{"url": url, "body": body}``.

    ``raw``: the message's bytes, used when the value cannot be serialized canonically.
    """
    value = {"body": body, "url": url}
    if raw is None or len(raw) <= STREAM_ABOVE_BYTES:
        try:
            return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()
        except (TypeError, orjson.JSONEncodeError):  # nested past orjson's 254 levels
            pass
    # orjson reserves ~288 bytes per array item before it writes (a 1 MiB list of token
    # ids would cost ~150 MB for a moment); the standard encoder's chunks are hashed as
    # they come, in bounded memory. Both give the same bytes for the same value.
    digest = hashlib.sha256()
    try:
        for chunk in _CANONICAL.iterencode(value):
            digest.update(chunk.encode("utf-8"))
    except (RecursionError, TypeError, ValueError, UnicodeError):
        return raw_fingerprint(raw if raw is not None else b"", None)
    return digest.hexdigest()


#: Messages larger than this are fingerprinted by the streaming encoder.
STREAM_ABOVE_BYTES = 64 << 10

_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)


def raw_fingerprint(raw: bytes | bytearray, size: int | None) -> str:
    """The fingerprint of a message by its bytes (``size``: its full size if cut short)."""
    digest = hashlib.sha256(b"qworker-raw\0")
    digest.update(str(len(raw) if size is None else size).encode() + b"\0")
    digest.update(raw)
    return digest.hexdigest()
