"""``/v1/responses`` jobs through ``qworker generate`` and the file spool worker.

The echo engine for the paths (each answer is its prompt), the tiny real model for
``text.format`` constraints; every result body validates as the openai SDK's
``Response`` (tests/schema/openai_types.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from qworker.cli import main
from qworker.schema import error_of
from tests.schema.openai_types import validate_line
from tests.worker.harness import file_source, serve, settings
from tests.worker.jobs import chat_job, read_results, write_spool

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                  "maximum": 99}},
          "required": ["id"], "additionalProperties": False}


def responses_job(custom_id: str, **body: Any) -> dict[str, Any]:
    """A /v1/responses job line (dict)."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
            "body": {"input": "hello", **body}}


def _lines() -> list[dict[str, Any]]:
    return [
        responses_job("plain", model="echo", instructions="Be brief.", max_output_tokens=200,
                      metadata={"k": "v"}),
        responses_job("items", input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                              "text": "part one"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"role": "user", "content": "part two"}]),
        responses_job("cut", max_output_tokens=3),
        responses_job("tools", tools=[{"type": "function", "name": "f", "parameters": {}}]),
        responses_job("other-model", model="gpt-4o-mini"),
        chat_job("chat"),  # a chat job beside them, unharmed
    ]


def _check(records: dict[str, dict[str, Any]]) -> None:
    kinds = {cid: validate_line(r) for cid, r in records.items()}
    assert kinds == {"plain": "response", "items": "response", "cut": "response",
                     "tools": "400", "other-model": "404", "chat": "chat"}
    plain = records["plain"]["response"]["body"]
    assert plain["status"] == "completed" and plain["instructions"] == "Be brief."
    assert plain["metadata"] == {"k": "v"} and plain["model"] == "echo"
    assert plain["output"][0]["content"][0]["text"] == "system: Be brief.\nuser: hello\n"
    items = records["items"]["response"]["body"]["output"][0]["content"][0]["text"]
    assert items == "user: part one\nassistant: ok\nuser: part two\n"
    cut = records["cut"]["response"]["body"]
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["usage"]["output_tokens"] == 3
    tools = error_of(records["tools"])
    assert tools is not None and tools["param"] == "tools"
    assert "not supported by qworker" in tools["message"]
    other = error_of(records["other-model"])
    assert other is not None and other["code"] == "model_not_found"


def test_responses_jobs_through_the_file_spool_worker(tmp_path: Path) -> None:
    source, uri = file_source(tmp_path, _lines())
    asyncio.run(serve(settings(tmp_path, uri), source, tmp_path / "out"))
    _check(read_results(tmp_path / "out"))


def test_responses_jobs_through_generate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    spool = write_spool(tmp_path / "in.jsonl", _lines())
    out = tmp_path / "results.jsonl"
    assert main(["generate", "-i", str(spool), "-o", str(out), "--model", "echo://"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [j["custom_id"] for j in _lines()]
    _check({r["custom_id"]: r for r in records})


def test_text_format_constrains_a_real_model_and_a_bad_schema_names_the_field(
    tmp_path: Path, tiny_chat_model_dir: Path,
) -> None:
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    import io

    from qworker.engine.config import EngineConfig
    from qworker.engine.engine import Engine
    from qworker.worker.generate import generate_file

    engine = Engine(EngineConfig(model=str(tiny_chat_model_dir), dtype="float32",
                                 device="cpu", max_model_len=256, num_kv_blocks=64))
    fmt = {"type": "json_schema", "name": "t", "schema": SCHEMA, "strict": True}
    bad = {**fmt, "schema": {"type": "integer", "minimum": 5, "maximum": 1}}
    lines = [responses_job("json", max_output_tokens=40, text={"format": fmt}),
             responses_job("bad", max_output_tokens=40, text={"format": bad}),
             responses_job("free", max_output_tokens=4, temperature=0)]
    out = io.BytesIO()
    generate_file(engine, str(write_spool(tmp_path / "in.jsonl", lines)), out, progress=None)
    records = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert validate_line(records["json"]) == "response"
    body = records["json"]["response"]["body"]
    assert body["status"] == "completed" and body["text"] == {"format": fmt}
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), SCHEMA)
    err = error_of(records["bad"])
    assert err is not None and err["code"] == "invalid_request"
    assert err["message"].startswith("body.text.format.schema is invalid or unsupported")
    assert err["param"] == "text.format.schema"
    free = records["free"]["response"]["body"]
    assert validate_line(records["free"]) == "response" and free["usage"]["output_tokens"] <= 4
