"""Every kind of result line is exactly what the openai SDK's types accept.

Lines come from the real paths: ``qworker generate`` (``generate_file``) and the worker
(file source -> worker -> file sink), both over the echo engine, plus records built
directly with realistic logprobs (including a token the model ruled out, -inf).
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")

from qworker.config import WorkerSettings
from qworker.engine.outputs import CompletionOutput, RequestOutput
from qworker.schema import parse_job, success_record
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.generate import generate_file
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.schema.openai_types import validate_line
from tests.worker.jobs import chat_job, completion_job, read_results, write_spool


class _FailingEcho(EchoEngine):
    """Echo, except that a prompt containing "explode" fails on its own (an engine error)."""

    def _output(self, req: Any, now: float) -> RequestOutput:
        out = super()._output(req, now)
        if req.prompt and "explode" in req.prompt:
            out.error = "CUDA error: an illegal memory access was encountered"
        return out


def _lines() -> list[dict[str, Any] | str]:
    return [
        {**chat_job("chat-1", "hello there"), "metadata": {"team": "a"}},
        chat_job("chat-lp", "hi", n=2, logprobs=True, top_logprobs=2, seed=3),
        completion_job("cmpl-1", "abc", n=2, logprobs=2),
        completion_job("cmpl-ids", [104, 105]),
        chat_job("bad-temp", temperature=-1),
        completion_job("too-long", "x" * 200),
        {**chat_job("late"), "deadline": time.time() - 10},
        completion_job("boom", "please explode"),
    ]


EXPECTED = {"chat-1": "chat", "chat-lp": "chat", "cmpl-1": "completion",
            "cmpl-ids": "completion", "bad-temp": "400", "too-long": "400", "late": "expired",
            "boom": "500"}


def test_generate_writes_lines_the_sdk_accepts(tmp_path: Path) -> None:
    path = write_spool(tmp_path / "in.jsonl", [*_lines(), "not json"])
    out = io.BytesIO()
    generate_file(_FailingEcho(max_model_len=64), str(path), out, progress=None)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    kinds = {r["custom_id"]: validate_line(r) for r in records}
    assert kinds == {**EXPECTED, None: "400"}
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["chat-1"]["response"]["body"]["model"] == "echo"
    assert by_id["chat-1"]["metadata"] == {"team": "a"}
    assert len(by_id["chat-lp"]["response"]["body"]["choices"]) == 2
    assert by_id["too-long"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert by_id["bad-temp"]["response"]["body"]["error"]["param"] == "temperature"


def test_the_worker_stores_lines_the_sdk_accepts(tmp_path: Path) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", _lines())
    settings = WorkerSettings(source=f"file://{spool}", sink=f"file://{tmp_path}/out",
                              model="echo://", until_idle=0.3, metrics_port=0,
                              spot_metadata_url="")

    async def main() -> None:
        worker = Worker(settings, _FailingEcho(max_model_len=64), FileSource(spool),
                        FileSink(tmp_path / "out"))
        await asyncio.wait_for(worker.run(), 30)

    asyncio.run(main())
    results = read_results(tmp_path / "out")
    assert {cid: validate_line(r) for cid, r in results.items()} == EXPECTED


def test_realistic_logprobs_validate_in_both_shapes() -> None:
    out = RequestOutput("r", "p", [1, 2, 3], [
        CompletionOutput(i, f"t{i}", [5, 6], -2.0,
                         [{5: -0.1, 9: -2.5, 7: -math.inf}, {6: -0.2, 9: -1.9}], "length")
        for i in range(2)
    ], True, num_cached_tokens=2)
    for url, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                "logprobs": True, "top_logprobs": 3, "n": 2}),
                      ("/v1/completions", {"prompt": "x", "logprobs": 3, "n": 2})):
        job = parse_job(json.dumps({"custom_id": "c", "url": url, "body": body}).encode()).job
        assert job is not None
        record = success_record(job, out, "SmolLM2-135M-Instruct", lambda t: f"<{t}>")
        record = json.loads(json.dumps(record))  # as stored: JSON, no -inf
        assert validate_line(record) in ("chat", "completion")
        usage = record["response"]["body"]["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
        text = json.dumps(record)
        assert "Infinity" not in text and "-9999.0" in text
