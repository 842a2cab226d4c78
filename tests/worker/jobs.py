"""Helpers shared by the worker tests: job lines, spool files, result reading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def chat_job(custom_id: str, text: str = "hello", **body: Any) -> dict[str, Any]:
    """A chat job line (dict) with small defaults."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": text}], "max_tokens": 8,
                     "temperature": 0, **body}}


def completion_job(custom_id: str, prompt: str | list[int] = "hello",
                   **body: Any) -> dict[str, Any]:
    """A completion job line (dict)."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 8, "temperature": 0, **body}}


def write_spool(path: Path, lines: list[dict[str, Any] | str | bytes]) -> Path:
    """Write job lines (dicts are JSON-encoded, str/bytes written raw) to a JSONL file."""
    with path.open("wb") as out:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            if isinstance(line, str):
                line = line.encode()
            out.write(line + b"\n")
    return path


def read_results(root: Path) -> dict[str, dict[str, Any]]:
    """custom_id -> record for every result file under a file:// sink directory."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(root.rglob("*.json")):
        if any(part.startswith("_") for part in path.relative_to(root).parts):
            continue  # qworker's own objects: fingerprints, conflicts, the manifest
        record = json.loads(path.read_text())
        assert record["custom_id"] not in out, f"two results for {record['custom_id']}"
        out[record["custom_id"]] = record
    return out


def acked_lines(progress: Path) -> set[int]:
    """Line numbers recorded as done in a file source's progress log."""
    done: set[int] = set()
    if not progress.exists():
        return done
    for line in progress.read_text().splitlines():
        if line.startswith("done_through "):
            done.update(range(1, int(line.split()[1]) + 1))
        elif line.strip().isdigit():
            done.add(int(line))
    return done

