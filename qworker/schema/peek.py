"""Read a message's ``custom_id`` and ``batch_id`` without parsing it (bounded work).

A message over ``max_job_bytes`` is never parsed (docs/formats.md, "Jobs"): parsing a
200 MB line costs several times its size in memory. ``peek_ids`` scans the raw bytes
once with a regular expression (C speed, no copy of the values it skips) for the
top-level keys only, so the job can still get its ``invalid_request`` line under its
own key. The scan gives up after ``max_tokens`` JSON tokens (a deeply nested or
token-dense message) and reports what it could not see.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# A JSON string (unrolled, so a huge string is one fast match) or one structural byte.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\],:]')
_WANTED = (b'"custom_id"', b'"batch_id"')
#: Longest id value decoded (bytes of its JSON text); longer ones count as unreadable.
MAX_ID_TEXT = 64 << 10
MAX_TOKENS = 200_000


@dataclass(slots=True)
class PeekedIds:
    """What ``peek_ids`` found at the top level of a message.

    ``complete``: the scan reached the end of the top-level object, so a key it did not
    see is truly absent. ``custom_id`` / ``batch_id`` are None when absent, unreadable
    or not strings.
    """

    custom_id: str | None = None
    batch_id: str | None = None
    saw_batch_id: bool = False
    complete: bool = False

    @property
    def batch_known(self) -> bool:
        """True when the job's batch is certain (seen, or certainly absent)."""
        return self.saw_batch_id or self.complete


def peek_ids(body: bytes | bytearray, max_tokens: int = MAX_TOKENS) -> PeekedIds:
    """The top-level ``custom_id`` / ``batch_id`` of a JSON object message; never raises."""
    found = PeekedIds()
    start = _skip_space(body, 0)
    if start >= len(body) or body[start:start + 1] != b"{":
        return found
    depth, expect, key = 1, "key", b""
    for count, match in enumerate(_TOKEN.finditer(body, start + 1)):
        if count >= max_tokens:
            return found
        first = body[match.start()]
        if depth > 1:
            if first in b"{[":
                depth += 1
            elif first in b"}]":
                depth -= 1
                if depth == 1:
                    expect = ","
            continue
        if first == 0x7D:  # "}" closes the top-level object
            found.complete = True
            return found
        if expect == "key":
            if first == 0x22:
                key = body[match.start():match.end()] if match.end() - match.start() <= 64 \
                    else b""
                expect = ":"
        elif expect == ":":
            expect = "value" if first == 0x3A else "key"
        elif expect == "value":
            if first == 0x22:
                _take(found, key, body, match.start(), match.end())
                expect = ","
            elif first in b"{[":
                depth += 1
                _take(found, key, body, -1, -1)
                expect = ","
            elif first == 0x2C:  # a number or literal ended
                _take(found, key, body, -1, -1)
                expect = "key"
        elif first == 0x2C:
            expect = "key"
    return found


def _take(found: PeekedIds, key: bytes, body: bytes | bytearray, start: int, end: int) -> None:
    if key not in _WANTED:
        return
    value: str | None = None
    if 0 <= start < end and end - start <= MAX_ID_TEXT:
        try:
            decoded = json.loads(bytes(body[start:end]))
            if isinstance(decoded, str) and decoded:
                decoded.encode("utf-8")  # a lone surrogate can never be a key
                value = decoded
        except (ValueError, UnicodeError):
            value = None
    if key == b'"custom_id"':
        found.custom_id = value
    else:
        found.batch_id = value
        found.saw_batch_id = True


def _skip_space(body: bytes | bytearray, pos: int) -> int:
    while pos < len(body) and body[pos] in b" \t\r\n":
        pos += 1
    return pos
