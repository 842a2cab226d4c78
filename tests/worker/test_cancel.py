"""Workers honour ``qworker cancel``: jobs of a cancelled batch not yet in the engine get
``batch_cancelled``, jobs already generating finish, other batches are unharmed.

In-process over the file spool (the marker written as ``qworker cancel`` writes it), then
end to end through the CLI: ``produce`` -> SQS (moto) -> ``qworker run`` -> S3 (moto),
``cancel`` mid-run, ``status`` through in_progress / cancelling / cancelled.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qworker.batch.lifecycle import CancelMarker
from qworker.schema import cancel_key, error_of
from qworker.worker.cancel_watch import CancelWatch
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.sinks.file import FileSink
from qworker.worker.worker import Worker
from tests.schema.openai_types import validate_line
from tests.worker.harness import file_source, settings
from tests.worker.jobs import completion_job, read_results


def _jobs(batch: str, n: int) -> list[dict[str, Any]]:
    return [{**completion_job(f"{batch}-{i}", f"prompt number {i} of {batch}"),
             "batch_id": batch} for i in range(n)]


def _outcome(record: dict[str, Any]) -> str:
    error = error_of(record)
    return "ok" if error is None else str(error["code"])


def test_a_cancel_mid_run_answers_waiting_jobs_and_lets_running_ones_finish(
    tmp_path: Path,
) -> None:
    lines = [job for pair in zip(_jobs("A", 10), _jobs("B", 10), strict=True) for job in pair]
    source, uri = file_source(tmp_path, lines)
    out = tmp_path / "out"
    cfg = settings(tmp_path, uri, cancel_check_seconds=0.1, max_inflight_jobs=8)
    # each job takes ~0.6 s in the engine; a small pool lets only a few in at a time
    engine = EchoEngine(delay_ms=60, steps=10, num_kv_blocks=8)
    worker = Worker(cfg, engine, source, FileSink(out))
    running_at_cancel: set[str] = set()

    async def cancel_when_running() -> None:
        while not any(j.batch_id == "A" for j in worker.table.running.values()):
            await asyncio.sleep(0.01)
        running_at_cancel.update(j.custom_id for j in worker.table.running.values()
                                 if j.batch_id == "A" and j.custom_id)
        marker = out / cancel_key("", "A")
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(CancelMarker("A", int(time.time())).to_json())

    async def main() -> None:
        canceller = asyncio.create_task(cancel_when_running())
        await asyncio.wait_for(worker.run(), 60)
        await canceller

    asyncio.run(main())
    assert worker.exit_code == 0
    results = read_results(out)
    assert sorted(results) == sorted(j["custom_id"] for j in lines)  # one record each
    outcomes = {cid: _outcome(r) for cid, r in results.items()}
    assert all(outcomes[f"B-{i}"] == "ok" for i in range(10))
    assert running_at_cancel and all(outcomes[c] == "ok" for c in running_at_cancel)
    cancelled = [c for c, o in outcomes.items() if o == "batch_cancelled"]
    assert cancelled and all(c.startswith("A-") for c in cancelled)
    assert {o for c, o in outcomes.items() if c.startswith("A-")} == {"ok", "batch_cancelled"}
    for cid in cancelled:
        assert validate_line(results[cid]) == "cancelled"
        assert results[cid]["response"] is None and results[cid]["batch_id"] == "A"
    assert worker.summary.completed["batch_cancelled"] == len(cancelled)
    assert worker.summary.settled == worker.summary.received == len(lines)


def test_jobs_received_after_the_marker_are_answered_without_running(tmp_path: Path) -> None:
    out = tmp_path / "out"
    marker = out / cancel_key("", "A")
    marker.parent.mkdir(parents=True)
    marker.write_bytes(CancelMarker("A", 1).to_json())
    lines = _jobs("A", 3) + _jobs("B", 2)
    source, uri = file_source(tmp_path, lines)
    engine = EchoEngine()
    worker = Worker(settings(tmp_path, uri), engine, source, FileSink(out))
    asyncio.run(asyncio.wait_for(worker.run(), 30))
    outcomes = {cid: _outcome(r) for cid, r in read_results(out).items()}
    assert outcomes == {"A-0": "batch_cancelled", "A-1": "batch_cancelled",
                        "A-2": "batch_cancelled", "B-0": "ok", "B-1": "ok"}
    assert engine.stats().prompt_tokens == sum(
        len(j["body"]["prompt"].encode()) for j in _jobs("B", 2))  # A never reached it


class _FlakySink(FileSink):
    """A file sink whose reads fail ``failures`` times first."""

    def __init__(self, root: Path, failures: int) -> None:
        super().__init__(root)
        self.failures = failures
        self.reads = 0

    async def get(self, key: str) -> bytes | None:
        self.reads += 1
        if self.reads <= self.failures:
            raise OSError("connection reset")
        return await super().get(key)


def test_marker_lookups_are_spaced_by_the_interval_and_failures_are_retried(
    tmp_path: Path,
) -> None:
    sink = _FlakySink(tmp_path, failures=1)
    watch = CancelWatch(sink, "", interval=10.0, max_known=2)

    async def scenario() -> None:
        assert await watch.refresh({"A"}, now=100.0) == set()  # the read failed: not fatal
        assert await watch.refresh({"A"}, now=105.0) == set()  # not due yet
        assert sink.reads == 1
        (tmp_path / cancel_key("", "A")).parent.mkdir(parents=True)
        (tmp_path / cancel_key("", "A")).write_bytes(b"{}")
        assert await watch.refresh({"A", "B"}, now=110.0) == {"A"}
        assert sink.reads == 3  # A again, B for the first time
        assert await watch.refresh({"A"}, now=200.0) == {"A"}  # cancelled stays: no read
        assert sink.reads == 3
        await watch.lookup_new(["C", "D", None], now=200.0)
        assert sink.reads == 5
        # C is not held but was looked up recently: a job of it arriving now costs no
        # lookup; one interval later it does
        assert await watch.refresh({"A"}, now=203.0) == {"A"}
        await watch.lookup_new(["C"], now=205.0)
        assert sink.reads == 5
        await watch.lookup_new(["C", "D"], now=211.0)
        assert sink.reads == 7

    asyncio.run(scenario())
    assert watch.is_cancelled("A") and not watch.is_cancelled("B")
    for batch in ("X", "Y", "Z"):
        watch._remember(batch)
    assert not watch.is_cancelled("A") and len(watch._cancelled) == 2  # bounded


# ---------------------------------------------------------------- end to end (CLI)

pytest.importorskip("boto3")


def _qworker(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qworker", *args], env=env,
                          capture_output=True, timeout=timeout)


def _status(sink: str, batch: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``qworker status`` in this process (fast enough to see ``cancelling``)."""
    from qworker.cli import main
    from tests.schema.openai_types import validate_batch

    capsys.readouterr()
    assert main(["status", "--from", sink, "--batch-id", batch, "--no-cache"]) == 0
    status = json.loads(capsys.readouterr().out)
    validate_batch(status)
    return status


def test_sqs_worker_to_s3_cancelled_mid_run_through_the_cli(
    tmp_path: Path, sqs_queue: Callable[..., Any], s3_bucket: str, moto_server: str,
    aws_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from qworker.cli import main
    from tests.fixtures.servers import boto_client, running

    url = sqs_queue().url
    sink = f"s3://{s3_bucket}/out"
    # At most 6 jobs in the worker, ~1.5 s each in the engine: a cancel just after the
    # worker took its first jobs of A finds them generating and the rest not started.
    env = {**aws_env, "QWORKER_MODEL": "echo://?delay_ms=100&steps=15&num_kv_blocks=8",
           "QWORKER_METRICS_PORT": "0", "QWORKER_SPOT_METADATA_URL": "",
           "QWORKER_CANCEL_CHECK_SECONDS": "0.5", "QWORKER_MAX_INFLIGHT_JOBS": "6",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for name in ("QWORKER_S3_ENDPOINT_URL", "XDG_CACHE_HOME", *(
            k for k in env if k.startswith("AWS_"))):
        monkeypatch.setenv(name, env[name])
    for batch in ("A", "B"):
        path = tmp_path / f"{batch}.jsonl"
        path.write_text("".join(json.dumps(j) + "\n" for j in _jobs(batch, 12)))
        done = _qworker("produce", "-i", str(path), "--to", f"sqs://{url}", "--batch-id",
                        batch, "--results", sink, env=env)
        assert done.returncode == 0, done.stderr.decode()
    assert _status(sink, "A", capsys)["status"] == "in_progress"

    s3 = boto_client("s3", moto_server)

    def stored(batch: str) -> list[str]:
        page = s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"out/{batch}/", Delimiter="/")
        return [o["Key"] for o in page.get("Contents", [])
                if not o["Key"].rsplit("/", 1)[1].startswith("_")]

    cmd = [sys.executable, "-m", "qworker", "run", "--source", f"sqs://{url}", "--sink", sink,
           "--until-idle", "1"]
    sqs = boto_client("sqs", moto_server)

    def in_flight() -> int:
        attrs = sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
        return int(attrs["Attributes"]["ApproximateNumberOfMessagesNotVisible"])

    with running(cmd, env, tmp_path / "worker.log") as proc:
        deadline = time.monotonic() + 60
        while not in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        # A's first jobs are received: give them time to reach the engine (where they
        # generate for ~1.5 s), then cancel while they run
        time.sleep(0.4)
        assert not stored("A")
        assert main(["cancel", "--from", sink, "--batch-id", "A"]) == 0
        status = _status(sink, "A", capsys)
        assert status["status"] == "cancelling" and status["cancelling_at"]
        assert proc.wait(timeout=90) == 0, (tmp_path / "worker.log").read_text()[-3000:]

    records = {}
    for batch in ("A", "B"):
        keys = stored(batch)
        assert len(keys) == 12  # exactly one record per job
        for key in keys:
            record = json.loads(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
            validate_line(record)
            records[record["custom_id"]] = _outcome(record)
    assert all(records[f"B-{i}"] == "ok" for i in range(12))
    a = [records[f"A-{i}"] for i in range(12)]
    assert "ok" in a and "batch_cancelled" in a and set(a) == {"ok", "batch_cancelled"}

    status = _status(sink, "A", capsys)
    assert status["status"] == "cancelled" and status["cancelled_at"] >= status["cancelling_at"]
    assert status["request_counts"] == {"total": 12, "completed": a.count("ok"),
                                        "failed": a.count("batch_cancelled")}
    assert _status(sink, "B", capsys)["status"] == "completed"


def test_a_short_completion_window_expires_the_jobs_and_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from qworker.cli import main
    from qworker.worker.sources.file import FileSource
    from tests.worker.jobs import write_spool

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "out"
    requests = write_spool(tmp_path / "in.jsonl", _jobs("E", 3))
    spool = tmp_path / "spool.jsonl"
    assert main(["produce", "-i", str(requests), "--to", f"file://{spool}", "--batch-id", "E",
                 "--results", f"file://{out}", "--completion-window", "1s"]) == 0
    time.sleep(1.2)
    worker = Worker(settings(tmp_path, f"file://{spool}"), EchoEngine(), FileSource(spool),
                    FileSink(out))
    asyncio.run(asyncio.wait_for(worker.run(), 30))
    results = read_results(out)
    assert {cid: _outcome(r) for cid, r in results.items()} == {
        f"E-{i}": "batch_expired" for i in range(3)}
    assert all(validate_line(r) == "expired" for r in results.values())
    status = _status(f"file://{out}", "E", capsys)
    assert status["status"] == "expired" and status["expired_at"] == status["expires_at"]
    assert status["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
