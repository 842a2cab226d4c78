"""Read a message's ``custom_id`` and ``batch_id`` without parsing it (bounded work).

A message over ``max_job_bytes`` is never parsed (docs/formats.md, "Jobs"): parsing a
200 MB line costs several times its size in memory. ``IdScanner`` reads the raw bytes
once, in chunks of any size (a spool line is fed as it is read, never held whole),
with regular expressions (C speed; the values it skips are never copied), and keeps
only the top-level ``custom_id`` and ``batch_id``. It gives up after ``max_tokens``
JSON tokens (a deeply nested or token-dense message) and reports what it could not
see. ``peek_ids`` scans one in-memory message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
_NEXT = re.compile(rb'["{}\[\],:]')
_WANTED = (b"custom_id", b"batch_id")
#: Longest id value kept (bytes of its JSON text); longer ones count as unreadable.
MAX_ID_TEXT = 64 << 10
MAX_TOKENS = 200_000
_MAX_KEY = 64


@dataclass(slots=True)
class PeekedIds:
    """What a scan found at the top level of a message.

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


class IdScanner:
    """Feed a message's bytes in order (``feed``), then read ``ids``; never raises."""

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.ids = PeekedIds()
        self._max_tokens = max_tokens
        self._tokens = 0
        self._started = False
        self._done = False
        self._depth = 0
        self._expect = "key"
        self._key = b""
        self._in_string = False
        self._escaped = False  # the previous chunk ended inside a string on a backslash
        self._capture: bytearray | None = None
        self._capture_limit = 0

    def feed(self, chunk: bytes | bytearray) -> None:
        """Scan the next bytes of the message."""
        pos, end = 0, len(chunk)
        while pos < end and not self._done:
            if self._in_string:
                pos = self._string(chunk, pos)
                continue
            if not self._started:
                while pos < end and chunk[pos] in b" \t\r\n":
                    pos += 1
                if pos == end:
                    return
                if chunk[pos] != 0x7B:  # "{": not an object, no ids
                    self._done = True
                    return
                self._started, self._depth = True, 1
                pos += 1
                continue
            match = _NEXT.search(chunk, pos)
            if match is None:
                return
            pos = match.end()
            self._tokens += 1
            if self._tokens > self._max_tokens:
                self._done = True
                return
            self._structural(chunk[match.start()])

    def _string(self, chunk: bytes | bytearray, pos: int) -> int:
        start = pos
        if self._escaped:  # the byte after a backslash that ended the last chunk
            self._escaped = False
            pos += 1
        match = _STRING_BODY.match(chunk, pos)
        stop = match.end() if match is not None else pos
        closed = stop < len(chunk) and chunk[stop] == 0x22
        if not closed and stop < len(chunk):  # a lone backslash at the chunk's end
            self._escaped = True
            stop = len(chunk)
        if self._capture is not None and len(self._capture) <= self._capture_limit:
            self._capture += chunk[start:stop]
        if not closed:
            return len(chunk)
        self._in_string = False
        self._string_done()
        return stop + 1

    def _open_string(self) -> None:
        self._in_string = True
        self._capture = None
        if self._depth == 1 and self._expect == "key":
            self._capture, self._capture_limit = bytearray(), _MAX_KEY
        elif self._depth == 1 and self._expect == "value" and self._key in _WANTED:
            self._capture, self._capture_limit = bytearray(), MAX_ID_TEXT

    def _string_done(self) -> None:
        if self._depth != 1:
            return
        if self._expect == "key":
            self._key = bytes(self._capture or b"")
            self._expect = ":"
        elif self._expect == "value":
            self._take(self._capture)
            self._expect = ","
        self._capture = None

    def _structural(self, byte: int) -> None:
        if byte == 0x22:  # '"'
            self._open_string()
            return
        if self._depth > 1:
            if byte in b"{[":
                self._depth += 1
            elif byte in b"}]":
                self._depth -= 1
                if self._depth == 1:
                    self._expect = ","
            return
        if byte == 0x7D:  # "}" closes the top-level object
            self.ids.complete = True
            self._done = True
        elif self._expect == ":":
            self._expect = "value" if byte == 0x3A else "key"
        elif self._expect == "value":
            if byte in b"{[":
                self._depth += 1
                self._take(None)
                self._expect = ","
            elif byte == 0x2C:  # a number or literal ended
                self._take(None)
                self._expect = "key"
        elif byte == 0x2C:
            self._expect = "key"

    def _take(self, raw: bytearray | None) -> None:
        if self._key not in _WANTED:
            return
        value: str | None = None
        if raw is not None and len(raw) <= MAX_ID_TEXT:
            try:
                decoded = json.loads(b'"' + bytes(raw) + b'"')
                if isinstance(decoded, str) and decoded:
                    decoded.encode("utf-8")  # a lone surrogate can never be a key
                    value = decoded
            except (ValueError, UnicodeError):
                value = None
        if self._key == b"custom_id":
            self.ids.custom_id = value
        else:
            self.ids.batch_id = value
            self.ids.saw_batch_id = True


def peek_ids(body: bytes | bytearray, max_tokens: int = MAX_TOKENS) -> PeekedIds:
    """The top-level ``custom_id`` / ``batch_id`` of one in-memory message; never raises."""
    scanner = IdScanner(max_tokens)
    scanner.feed(body)
    return scanner.ids
