"""Request fingerprints: a redelivery is a duplicate, a second request under one id a conflict.

Regression: jobs without ``batch_id`` from different batches share keys, so a later
request reusing a custom_id met the first one's result (a 412, or an existing file),
was acked as a duplicate, and silently kept the earlier answer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.cli import main
from qworker.config import WorkerSettings
from qworker.schema import conflict_key, error_of, request_fingerprint
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.worker.jobs import completion_job, read_results, write_spool


def _run(tmp_path: Path, name: str, lines: list[Any], metrics: WorkerMetrics) -> Worker:
    spool = write_spool(tmp_path / name, lines)
    settings = WorkerSettings(source=f"file://{spool}", sink=f"file://{tmp_path}/out",
                              model="echo://", until_idle=0.2, metrics_port=0,
                              spot_metadata_url="")

    async def go() -> Worker:
        worker = Worker(settings, EchoEngine(), FileSource(spool), FileSink(tmp_path / "out"),
                        metrics=metrics)
        await asyncio.wait_for(worker.run(), 30)
        return worker

    return asyncio.run(go())


def test_fingerprint_is_canonical_over_url_and_body_only() -> None:
    a = request_fingerprint("/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert a == request_fingerprint("/v1/completions", {"max_tokens": 3, "prompt": "x"})
    assert a != request_fingerprint("/v1/completions", {"prompt": "y", "max_tokens": 3})
    assert a != request_fingerprint("/v1/chat/completions", {"prompt": "x", "max_tokens": 3})
    deep: Any = 1
    for _ in range(400):  # past orjson's nesting limit: still a fingerprint
        deep = [deep]
    assert len(request_fingerprint("/v1/completions", {"prompt": deep})) == 64


def test_a_second_request_under_one_custom_id_gets_a_conflict_record_not_the_first_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    metrics = WorkerMetrics()
    first = completion_job("doc-1", "first answer")  # no batch_id: the "default" batch
    second = completion_job("doc-1", "another batch's request")
    _run(tmp_path, "monday.jsonl", [first], metrics)
    again = _run(tmp_path, "tuesday.jsonl", [first, second], metrics)

    results = read_results(tmp_path / "out")
    text = results["doc-1"]["response"]["body"]["choices"][0]["text"]
    assert text == "first an"  # max_tokens 8 of the echo: the first answer, kept
    assert again.summary.duplicates == 1 and again.summary.conflicts == 1
    fp = request_fingerprint(second["url"], second["body"])
    conflict = tmp_path / "out" / conflict_key("", None, "doc-1", fp)
    record = json.loads(conflict.read_text())
    error = error_of(record)
    assert error is not None and error["code"] == "duplicate_custom_id"
    assert record["custom_id"] == "doc-1"
    assert "qworker_jobs_conflict_total 1.0" in metrics.exposition().decode()
    assert again.summary.completed["duplicate_custom_id"] == 1

    # Redelivered again: the conflict record is written once, the answer still kept.
    third = _run(tmp_path, "wednesday.jsonl", [second], metrics)
    assert third.summary.conflicts == 1
    assert "qworker_jobs_conflict_total 1.0" in metrics.exposition().decode()
    assert len(list(conflict.parent.glob("*.json"))) == 1

    out, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    code = main(["collect", "--from", f"file://{tmp_path}/out", "--batch-id", "default",
                 "-o", str(out), "--errors", str(errors)])
    assert code == 0, capsys.readouterr().err
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["doc-1"]
    err_lines = [json.loads(x) for x in errors.read_text().splitlines()]
    assert [error_of(r)["code"] for r in err_lines] == ["duplicate_custom_id"]
