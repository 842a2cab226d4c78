"""Logging setup for the worker: plain text or one JSON object per line.

Job log calls pass ``extra={"custom_id": ..., "message_id": ...}``; the JSON
formatter carries every such extra as a top-level field.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message`` plus ``custom_id=... message_id=...`` when given."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = [
            f"{key}={getattr(record, key)!r}"
            for key in ("custom_id", "message_id")
            if getattr(record, key, None) is not None
        ]
        return f"{text} [{' '.join(ids)}]" if ids else text


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Route the root logger to stderr in the given format (replaces handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("botocore", "boto3", "urllib3", "aiokafka", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
