"""The batch lifecycle through the CLI: cancel, status states, completion window, endpoints.

Results are written as the worker writes them (keys, record shapes) so each state shows
without a worker; tests/worker/test_cancel.py runs real workers against a cancel.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

from qworker.cli import main
from qworker.errors import BatchCancelledError
from qworker.schema import (
    cancel_key,
    dumps,
    error_record,
    error_record_for,
    parse_job,
    result_key,
    success_record,
)
from qworker.worker.echo_engine import EchoEngine
from tests.fixtures.servers import boto_client
from tests.schema.openai_types import validate_batch, validate_line
from tests.worker.jobs import chat_job, completion_job, write_spool

IDS = [f"c{i}" for i in range(6)]


def _produce(tmp_path: Path, results: str, *extra: str, lines: list[Any] | None = None,
             capsys: pytest.CaptureFixture[str]) -> str:
    lines = lines or [completion_job(cid, f"prompt {cid}") for cid in IDS]
    spool = write_spool(tmp_path / "in.jsonl", lines)
    capsys.readouterr()
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/spool.jsonl",
                 "--results", results, *extra]) == 0
    return capsys.readouterr().out.strip()


def _status(capsys: pytest.CaptureFixture[str], results: str, batch: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["status", "--from", results, "--batch-id", batch, "--no-cache"]) == 0
    status = json.loads(capsys.readouterr().out)
    validate_batch(status)
    return status


def _served(tmp_path: Path, batch: str, cid: str) -> dict[str, Any]:
    for line in (tmp_path / "spool.jsonl").read_text().splitlines():
        parsed = parse_job(line.encode())
        if parsed.custom_id == cid:
            assert parsed.job is not None
            engine = EchoEngine()
            engine.add_request("r", parsed.job.prompt, parsed.job.params)
            (out,) = engine.step()
            return success_record(parsed.job, out, "echo")
    raise AssertionError(cid)


def _put_file(root: Path) -> Any:
    def put(key: str, body: bytes) -> None:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    return put


@pytest.fixture
def results_location(request: pytest.FixtureRequest, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any, Any]:
    """(results URI, put(key, bytes), get(key) -> bytes | None) for file:// or moto S3."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if request.param == "file":
        root = tmp_path / "results"
        return (f"file://{root}", _put_file(root),
                lambda key: (root / key).read_bytes() if (root / key).exists() else None)
    moto = request.getfixturevalue("moto_server")
    bucket = request.getfixturevalue("s3_bucket")
    monkeypatch.setenv("QWORKER_S3_ENDPOINT_URL", moto)
    s3 = boto_client("s3", moto)

    def get(key: str) -> bytes | None:
        try:
            return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except s3.exceptions.NoSuchKey:
            return None

    return (f"s3://{bucket}/out",
            lambda key, body: s3.put_object(Bucket=bucket, Key=key, Body=body), get)


@pytest.mark.parametrize("results_location", ["file", "s3"], indirect=True)
def test_cancel_writes_the_marker_once_and_status_goes_cancelling_then_cancelled(
    tmp_path: Path, results_location: tuple[str, Any, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    results, put, get = results_location
    prefix = "out" if results.startswith("s3://") else ""
    batch = _produce(tmp_path, results, capsys=capsys)
    status = _status(capsys, results, batch)
    assert status["status"] == "in_progress" and status["cancelling_at"] is None
    assert status["endpoint"] == "/v1/completions" and status["completion_window"] == "24h"
    assert status["expires_at"] == pytest.approx(time.time() + 86400, abs=30)
    put(result_key(prefix, batch, "c0"), dumps(_served(tmp_path, batch, "c0")))

    assert main(["cancel", "--from", results, "--batch-id", batch]) == 0
    out, err = capsys.readouterr()
    first = json.loads(out)
    assert first["already_cancelled"] is False and "is cancelling" in err
    marker = json.loads(get(cancel_key(prefix, batch)) or b"null")
    assert marker["cancelling_at"] == first["cancelling_at"]

    assert main(["cancel", "--from", results, "--batch-id", batch]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["already_cancelled"] is True
    assert "already cancelled" in err and "nothing changed" in err
    assert json.loads(get(cancel_key(prefix, batch)) or b"null") == marker

    status = _status(capsys, results, batch)
    assert status["status"] == "cancelling"
    assert status["cancelling_at"] == first["cancelling_at"] and status["cancelled_at"] is None
    assert status["request_counts"] == {"total": 6, "completed": 1, "failed": 0}

    for cid in IDS[1:]:
        record = error_record_for(cid, batch, BatchCancelledError("the batch was cancelled"))
        validate_line(record)
        put(result_key(prefix, batch, cid), dumps(record))
    status = _status(capsys, results, batch)
    assert status["status"] == "cancelled"
    assert status["cancelled_at"] >= status["cancelling_at"]
    # every job answered: a cancel again is still "already cancelled", not "ended"
    assert main(["cancel", "--from", results, "--batch-id", batch]) == 0
    assert json.loads(capsys.readouterr().out)["already_cancelled"] is True
    assert status["request_counts"] == {"total": 6, "completed": 1, "failed": 5}
    assert status["usage"]["input_tokens"] > 0
    assert status["usage"]["total_tokens"] == (status["usage"]["input_tokens"]
                                               + status["usage"]["output_tokens"])


@pytest.mark.parametrize("results_location", ["file", "s3"], indirect=True)
def test_cancel_of_a_batch_without_a_manifest_is_one_line_and_exit_1(
    results_location: tuple[str, Any, Any], capsys: pytest.CaptureFixture[str],
) -> None:
    results, _put, get = results_location
    assert main(["cancel", "--from", results, "--batch-id", "nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no batch 'nope'" in err and err.startswith("qworker cancel")
    prefix = "out" if results.startswith("s3://") else ""
    assert get(cancel_key(prefix, "nope")) is None


def test_a_short_completion_window_stamps_deadlines_and_the_batch_expires(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "results"
    results, put = f"file://{root}", _put_file(root)
    early = int(time.time()) + 1
    lines = [completion_job(cid, f"prompt {cid}") for cid in IDS]
    lines[1]["deadline"] = early  # earlier than the window: kept
    lines[2]["deadline"] = early + 10_000  # later: replaced
    batch = _produce(tmp_path, results, "--completion-window", "2s", lines=lines,
                     capsys=capsys)
    sent = {parse_job(x.encode()).custom_id: json.loads(x)
            for x in (tmp_path / "spool.jsonl").read_text().splitlines()}
    status = _status(capsys, results, batch)
    assert status["status"] == "in_progress" and status["completion_window"] == "2s"
    expires = status["expires_at"]
    assert sent["c1"]["deadline"] == early
    assert {sent[c]["deadline"] for c in IDS if c != "c1"} == {expires}

    put(result_key("", batch, "c0"), dumps(_served(tmp_path, batch, "c0")))
    time.sleep(max(0.0, expires - time.time()) + 0.1)
    status = _status(capsys, results, batch)
    assert status["status"] == "expired" and status["expired_at"] == expires
    # an expired batch stays expired: cancel refuses it and writes no marker
    assert main(["cancel", "--from", results, "--batch-id", batch]) == 1
    assert "already ended" in capsys.readouterr().err
    assert not (root / cancel_key("", batch)).exists()
    for cid in IDS[1:]:
        put(result_key("", batch, cid), dumps(error_record(
            cid, batch, "batch_expired", "deadline passed before the job started")))
    status = _status(capsys, results, batch)
    assert status["status"] == "expired"
    assert status["request_counts"] == {"total": 6, "completed": 1, "failed": 5}


def test_status_completed_sums_usage_and_shows_the_files_collect_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "results"
    results, put = f"file://{root}", _put_file(root)
    batch = _produce(tmp_path, results, capsys=capsys)
    expected_in = expected_out = 0
    for cid in IDS[:-1]:
        record = _served(tmp_path, batch, cid)
        usage = record["response"]["body"]["usage"]
        expected_in += usage["prompt_tokens"]
        expected_out += usage["completion_tokens"]
        put(result_key("", batch, cid), dumps(record))
    put(result_key("", batch, IDS[-1]), dumps(error_record(
        IDS[-1], batch, "invalid_request", "body.n is bad", param="n")))
    status = _status(capsys, results, batch)
    assert status["status"] == "completed" and status["completed_at"] >= status["created_at"]
    # OpenAI: a completed batch stays completed; cancel refuses it
    assert main(["cancel", "--from", results, "--batch-id", batch]) == 1
    assert "already ended" in capsys.readouterr().err
    assert _status(capsys, results, batch)["status"] == "completed"
    assert status["usage"] == {
        "input_tokens": expected_in, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": expected_out, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": expected_in + expected_out}
    assert status["output_file_id"] is None and status["error_file_id"] is None

    out, errors = tmp_path / "results.jsonl", tmp_path / "errors.jsonl"
    assert main(["collect", "--from", results, "--batch-id", batch, "-o", str(out),
                 "--errors", str(errors), "--no-progress"]) == 0
    status = _status(capsys, results, batch)
    assert status["output_file_id"] == str(out) and status["error_file_id"] == str(errors)


def test_produce_refuses_mixed_endpoints_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    results = f"file://{tmp_path}/results"
    lines = [completion_job("a"), chat_job("b"), chat_job("c")]
    spool = write_spool(tmp_path / "in.jsonl", lines)
    capsys.readouterr()
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/spool.jsonl",
                 "--results", results]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--allow-mixed" in err
    assert "/v1/chat/completions (2 lines)" in err and "/v1/completions (1 lines)" in err
    assert not (tmp_path / "spool.jsonl").exists()

    batch = _produce(tmp_path, results, "--allow-mixed", lines=lines, capsys=capsys)
    status = _status(capsys, results, batch)
    assert status["endpoint"] == "mixed" and status["request_counts"]["total"] == 3


def test_a_produce_that_fails_while_sending_reads_as_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    results = f"file://{tmp_path}/results"
    spool = write_spool(tmp_path / "in.jsonl", [completion_job(c) for c in IDS])
    (tmp_path / "blocker").write_text("a file, not a directory")
    with pytest.raises(OSError):
        main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/blocker/spool.jsonl",
              "--results", results, "--batch-id", "b1"])
    status = _status(capsys, results, "b1")
    assert status["status"] == "failed" and status["failed_at"] is not None
    assert status["errors"]["data"][0]["code"] == "produce_failed"
    assert "Error" in status["errors"]["data"][0]["message"]

    time.sleep(1.05)  # the same file sent again, and this time all of it: no longer failed
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/spool.jsonl",
                 "--results", results, "--batch-id", "b1"]) == 0
    status = _status(capsys, results, "b1")
    assert status["status"] == "in_progress" and status["errors"] is None


def test_usage_is_read_from_chat_responses_and_embeddings_bodies() -> None:
    from qworker.batch.status import _usage, outcome_of

    def line(body: dict[str, Any]) -> bytes:
        return dumps({"id": "batch_req_x", "custom_id": "x", "response": {
            "status_code": 200, "request_id": "req_x", "body": body}, "error": None})

    chat = outcome_of(line({"object": "chat.completion", "created": 5, "usage": {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8}}}))
    responses = outcome_of(line({"object": "response", "created_at": 7, "usage": {
        "input_tokens": 6, "output_tokens": 3, "total_tokens": 9,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 2}}}))
    embeddings = outcome_of(line({"object": "list", "usage": {
        "prompt_tokens": 5, "total_tokens": 5}}))
    failed = outcome_of(dumps(error_record("y", None, "batch_cancelled", "cancelled")))
    assert (chat.created, responses.created, failed.code) == (5, 7, "batch_cancelled")
    # an embeddings body carries no time: the line's is when it was stored
    assert embeddings.created == 0
    assert outcome_of(line({"object": "list", "usage": {}}), stored_at=9).created == 9
    assert outcome_of(line({"object": "chat.completion", "created": 5}), stored_at=9).created == 5
    assert _usage([chat, responses, embeddings, failed]) == {
        "input_tokens": 21, "input_tokens_details": {"cached_tokens": 8},
        "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 28}


def test_lifecycle_status_checks_in_order() -> None:
    from qworker.batch.lifecycle import CancelMarker, FailedMarker
    from qworker.batch.manifest import Manifest, ManifestState
    from qworker.batch.status import lifecycle_status

    def manifest(state: str = ManifestState.SENT, sent_at: int | None = 100) -> Manifest:
        return Manifest("b", 2, "in", 90, ["x", "y"], expires_at=200, state=state,
                        sent_at=sent_at)

    cancel, failed = CancelMarker("b", 150), FailedMarker("b", 120, "boom")
    assert lifecycle_status(None, 1, 0, None, None, 999) == "in_progress"
    assert lifecycle_status(manifest(sent_at=None), 2, 0, None, failed, 130) == "failed"
    assert lifecycle_status(manifest(), 2, 0, None, failed, 130) == "failed"  # newer than sent
    assert lifecycle_status(manifest(sent_at=125), 2, 0, None, failed, 130) == "in_progress"
    assert lifecycle_status(manifest(ManifestState.SENDING, None), 2, 0, None, None,
                            95) == "validating"
    assert lifecycle_status(manifest(), 1, 0, cancel, None, 999) == "cancelling"
    assert lifecycle_status(manifest(), 0, 1, cancel, None, 999) == "cancelled"
    assert lifecycle_status(manifest(), 1, 0, None, None, 150) == "in_progress"
    assert lifecycle_status(manifest(), 1, 0, None, None, 200) == "expired"
    assert lifecycle_status(manifest(), 0, 1, None, None, 150) == "completed"
    assert lifecycle_status(manifest(), 0, 1, None, None, 250) == "expired"
    assert lifecycle_status(manifest(), 0, 0, None, None, 250) == "completed"


def test_a_batch_still_being_sent_reads_validating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from qworker.batch.manifest import Manifest, ManifestState, write_manifest
    from qworker.batch.store import DirStore

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "results"
    write_manifest(DirStore(root), Manifest("v1", 2, "in.jsonl", int(time.time()), ["a", "b"],
                                            endpoint="/v1/embeddings",
                                            state=ManifestState.SENDING))
    status = _status(capsys, f"file://{root}", "v1")
    assert status["status"] == "validating" and status["in_progress_at"] is None
    assert status["endpoint"] == "/v1/embeddings"


def test_completion_window_none_sends_lines_unstamped_and_a_bad_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    results = f"file://{tmp_path}/results"
    batch = _produce(tmp_path, results, "--completion-window", "none", capsys=capsys)
    sent = [json.loads(x) for x in (tmp_path / "spool.jsonl").read_text().splitlines()]
    assert all("deadline" not in job for job in sent)
    status = _status(capsys, results, batch)
    assert status["completion_window"] == "none" and status["expires_at"] is None

    spool = write_spool(tmp_path / "in2.jsonl", [completion_job("z")])
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/s2.jsonl",
                 "--results", results, "--completion-window", "tomorrow"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "must be a duration such as 24h" in err


def test_the_status_cache_does_not_outlive_a_batch_produced_again_in_an_emptied_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "results"
    results, put = f"file://{root}", _put_file(root)
    batch = _produce(tmp_path, results, "--batch-id", "again", capsys=capsys)
    for cid in IDS:
        put(result_key("", batch, cid), dumps(error_record(cid, batch, "model_not_found",
                                                           "no such model", param="model")))

    def cached_status() -> dict[str, Any]:
        capsys.readouterr()
        assert main(["status", "--from", results, "--batch-id", batch]) == 0
        return json.loads(capsys.readouterr().out)

    assert cached_status()["request_counts"] == {"total": 6, "completed": 0, "failed": 6}
    shutil.rmtree(root)  # the same folder and batch id, a new run
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 5)  # a later second
    assert _produce(tmp_path, results, "--batch-id", "again", capsys=capsys) == batch
    for cid in IDS:
        put(result_key("", batch, cid), dumps(_served(tmp_path, batch, cid)))
    assert cached_status()["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
