"""Structured-output jobs through ``qworker generate`` with the real engine: good jobs
answer valid JSON, a bad schema gets its own invalid_request record, nothing else
suffers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

pytest.importorskip("orjson")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from qworker.engine.config import EngineConfig  # noqa: E402
from qworker.engine.engine import Engine  # noqa: E402
from qworker.schema import error_of  # noqa: E402
from qworker.worker.generate import generate_file  # noqa: E402
from tests.worker.jobs import chat_job, completion_job, write_spool  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["a", "b"]}},
          "required": ["id", "tag"], "additionalProperties": False}


def _format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def test_a_bad_schema_is_its_jobs_error_and_the_rest_of_the_file_is_served(
    tmp_path: Path, tiny_chat_model_dir: Path,
) -> None:
    engine = Engine(EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", device="cpu",
                                 max_model_len=256, num_kv_blocks=64))
    lines = [
        chat_job("json-1", max_tokens=40, response_format=_format(SCHEMA)),
        chat_job("bad", max_tokens=40, response_format=_format({"type": "integer",
                                                                "minimum": 5, "maximum": 1})),
        completion_job("free", "hello", max_tokens=5, ignore_eos=True),
        chat_job("json-2", max_tokens=40, temperature=1.0, seed=3, n=2,
                 structured_outputs={"json": SCHEMA}, presence_penalty=0.5),
        completion_job("choice", "pick", max_tokens=8, guided_choice=["yes", "no"]),
        chat_job("obj", max_tokens=60, temperature=1.0, seed=4,
                 response_format={"type": "json_object"}),
    ]
    out = io.BytesIO()
    stats = generate_file(engine, str(write_spool(tmp_path / "in.jsonl", lines)), out,
                          progress=None)
    records = {r["custom_id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert stats.lines == 6 and stats.errors == 1 and set(records) == {
        "json-1", "bad", "free", "json-2", "choice", "obj"}
    err = error_of(records["bad"])
    assert err is not None and err["code"] == "invalid_request"
    assert err["message"].startswith("body.response_format.json_schema.schema is invalid or "
                                     "unsupported: Unsatisfiable schema: minimum (5) is greater")
    for cid in ("json-1", "json-2"):
        choices = records[cid]["response"]["body"]["choices"]
        for choice in choices:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert len(records["json-2"]["response"]["body"]["choices"]) == 2
    assert records["choice"]["response"]["body"]["choices"][0]["text"] in ("yes", "no")
    obj = records["obj"]["response"]["body"]["choices"][0]
    assert obj["message"]["content"].startswith("{")
    assert records["free"]["response"]["body"]["usage"]["completion_tokens"] == 5
