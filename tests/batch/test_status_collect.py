"""status and collect over a batch stored in moto S3 (and a directory), via the CLI.

The batch is produced with ``qworker produce`` (manifest included) into a file spool;
its results are then written as the worker writes them (keys, record shapes), some
left missing and one conflict added, so every branch shows in one batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

from qworker.cli import main
from qworker.schema import (
    conflict_key,
    conflict_record,
    dumps,
    error_of,
    error_record,
    parse_job,
    result_key,
    success_record,
)
from qworker.worker.echo_engine import EchoEngine
from tests.fixtures.servers import boto_client
from tests.schema.openai_types import validate_batch, validate_line
from tests.worker.jobs import completion_job, write_spool

IDS = [f"q{i}" for i in range(12)]


def _output(job: Any) -> Any:
    engine = EchoEngine()
    engine.add_request("r", job.prompt, job.params)
    (out,) = engine.step()
    return out


def _write_results(put: Any, prefix: str, batch: str, spool: Path, ids: list[str]) -> None:
    for line in spool.read_text().splitlines():
        parsed = parse_job(line.encode())
        cid = parsed.custom_id
        if cid not in ids:
            continue
        if cid == "q3":
            record = error_record(cid, batch, "invalid_request", "body.n is bad", param="n")
        elif cid == "q4":
            record = error_record(cid, batch, "batch_expired", "deadline passed")
        else:
            assert parsed.job is not None
            record = success_record(parsed.job, _output(parsed.job), "echo")
        put(result_key(prefix, batch, cid), dumps(record))


def _produce(tmp_path: Path, results: str, env: dict[str, str] | None = None) -> str:
    spool = write_spool(tmp_path / "in.jsonl", [completion_job(cid, f"p-{cid}") for cid in IDS])
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/spool.jsonl",
                 "--results", results]) == 0
    return spool.read_text()


def _status(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["status", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_status_and_collect_follow_a_batch_to_completion_on_s3(
    tmp_path: Path, moto_server: str, s3_bucket: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWORKER_S3_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    results = f"s3://{s3_bucket}/out"
    _produce(tmp_path, results)
    batch = capsys.readouterr().out.strip()
    assert batch.startswith("batch_")
    s3 = boto_client("s3", moto_server)

    def put(key: str, body: bytes) -> None:
        s3.put_object(Bucket=s3_bucket, Key=key, Body=body)

    status = _status(capsys, "--from", results, "--batch-id", batch)
    assert status["status"] == "in_progress" and status["missing_count"] == 12
    assert status["request_counts"] == {"total": 12, "completed": 0, "failed": 0}

    spool = tmp_path / "spool.jsonl"
    _write_results(put, "out", batch, spool, IDS[:8])
    status = _status(capsys, "--from", results, "--batch-id", batch)
    validate_batch(status)
    assert status["status"] == "in_progress"
    assert status["request_counts"] == {"total": 12, "completed": 6, "failed": 2}
    assert status["missing"] == IDS[8:] and status["missing_count"] == 4

    # a conflict (written by the worker when two requests share q1) and the rest
    put(conflict_key("out", batch, "q1", "f" * 64),
        dumps(conflict_record("q1", batch, "f" * 64, "e" * 64)))
    _write_results(put, "out", batch, spool, IDS[8:])
    status = _status(capsys, "--from", results, "--batch-id", batch, "--wait", "0.1",
                     "--timeout", "5")
    assert validate_batch(status).status == "completed"
    assert status["request_counts"] == {"total": 12, "completed": 10, "failed": 2}
    assert status["missing"] == [] and status["conflicts"] == 1

    assert main(["collect", "--from", results, "--batch-id", batch, "-o",
                 f"s3://{s3_bucket}/collected/results.jsonl", "--errors",
                 f"s3://{s3_bucket}/collected/errors.jsonl"]) == 0
    out = s3.get_object(Bucket=s3_bucket, Key="collected/results.jsonl")["Body"].read()
    err = s3.get_object(Bucket=s3_bucket, Key="collected/errors.jsonl")["Body"].read()
    lines = [json.loads(x) for x in out.splitlines()]
    errors = [json.loads(x) for x in err.splitlines()]
    assert [r["custom_id"] for r in lines] == [c for c in IDS if c not in ("q3", "q4")]
    assert [e["custom_id"] for e in errors] == ["q3", "q4", "q1"]
    assert [error_of(e)["code"] for e in errors] == [
        "invalid_request", "batch_expired", "duplicate_custom_id"]
    for line in lines + errors:
        validate_line(line)


def test_collect_lists_missing_ids_in_input_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = f"file://{tmp_path}/results"
    _produce(tmp_path, results)
    batch = capsys.readouterr().out.strip()
    root = tmp_path / "results"

    def put(key: str, body: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(body)

    present = IDS[::2]
    _write_results(put, "", batch, tmp_path / "spool.jsonl", present)
    capsys.readouterr()
    assert main(["collect", "--from", results, "--batch-id", batch, "-o",
                 str(tmp_path / "r.jsonl"), "--missing", str(tmp_path / "missing.txt"),
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    missing = [c for c in IDS if c not in present]
    assert f"collect: {len(missing)} missing: {', '.join(missing)}" in err
    assert (tmp_path / "missing.txt").read_text().split() == missing
    got = [json.loads(x)["custom_id"] for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert got == present  # errors go to --output too without --errors, in input order


def test_produce_refuses_duplicates_and_sends_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spool = write_spool(tmp_path / "in.jsonl", [completion_job("a"), completion_job("a")])
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/spool.jsonl",
                 "--results", f"file://{tmp_path}/results"]) == 1
    assert "duplicate custom_id(s): 'a' on lines 1 and 2" in capsys.readouterr().err
    assert not (tmp_path / "spool.jsonl").exists()
    assert not (tmp_path / "results").exists()


def test_status_of_an_unknown_batch_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--from", f"file://{tmp_path}", "--batch-id", "nope"]) == 1
    assert "no batch 'nope'" in capsys.readouterr().err


def test_collect_of_an_unknown_batch_is_an_error_and_leaves_earlier_files_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = f"file://{tmp_path}/results"
    _produce(tmp_path, results)
    capsys.readouterr()
    earlier = tmp_path / "r.jsonl"
    earlier.write_text('{"kept": true}\n')
    assert main(["collect", "--from", results, "--batch-id", "typo", "-o", str(earlier),
                 "--no-progress"]) == 1
    assert "no batch 'typo'" in capsys.readouterr().err
    assert earlier.read_text() == '{"kept": true}\n'


def test_status_wait_refuses_a_batch_without_a_manifest_instead_of_waiting_forever(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # results written by workers, but no `qworker produce` manifest: never "completed"
    root = tmp_path / "results"

    def put(key: str, body: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(body)

    spool = write_spool(tmp_path / "in.jsonl", [completion_job(c, f"p-{c}") for c in IDS[:3]])
    _write_results(put, "", "nomanifest", spool, IDS[:3])
    capsys.readouterr()
    assert main(["status", "--from", f"file://{root}", "--batch-id", "nomanifest",
                 "--wait", "0.01", "--timeout", "30"]) == 1
    captured = capsys.readouterr()
    assert "has no manifest" in captured.err and "--wait" in captured.err
    assert json.loads(captured.out)["request_counts"]["total"] == 3


def test_a_missing_bucket_is_one_line_and_exit_1_for_every_batch_command(
    tmp_path: Path, moto_server: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWORKER_S3_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spool = write_spool(tmp_path / "in.jsonl", [completion_job("a")])
    where = "s3://no-such-bucket-r13/out"
    for argv in (["status", "--from", where, "--batch-id", "b"],
                 ["collect", "--from", where, "--batch-id", "b", "-o", str(tmp_path / "o")],
                 ["produce", "-i", str(spool), "--to", f"file://{tmp_path}/s.jsonl",
                  "--results", where],
                 ["produce", "-i", "s3://no-such-bucket-r13/in.jsonl", "--to",
                  f"file://{tmp_path}/s.jsonl", "--no-manifest"]):
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith(f"qworker {argv[0]}: "), err
        assert "NoSuchBucket" in err or "in.jsonl does not exist" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s.jsonl").exists()  # nothing sent when the manifest failed


def test_produce_never_replaces_another_files_manifest_under_the_same_batch_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = f"file://{tmp_path}/results"
    first = write_spool(tmp_path / "a.jsonl", [completion_job(c) for c in IDS])
    other = write_spool(tmp_path / "b.jsonl", [completion_job("z1"), completion_job("z2")])
    spool = tmp_path / "spool.jsonl"

    def produce(path: Path) -> int:
        return main(["produce", "-i", str(path), "--to", f"file://{spool}", "--batch-id",
                     "nightly", "--results", results])

    assert produce(first) == 0
    manifest = tmp_path / "results" / "nightly" / "_manifest.json"
    before = json.loads(manifest.read_text())
    sent = spool.read_text()
    capsys.readouterr()
    assert produce(other) == 1
    err = capsys.readouterr().err
    assert "batch 'nightly' already has a manifest (12 jobs from" in err and "--batch-id" in err
    assert spool.read_text() == sent  # nothing sent
    assert json.loads(manifest.read_text()) == before
    # sending the same file again (say, after a failed send) is fine and keeps `created`
    assert produce(first) == 0
    again = json.loads(manifest.read_text())
    assert (again["custom_ids"], again["created"]) == (IDS, before["created"])


def test_results_of_ids_outside_the_manifest_never_count_past_the_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    results = f"file://{tmp_path}/results"
    _produce(tmp_path, results)
    batch = capsys.readouterr().out.strip()
    root = tmp_path / "results"

    def put(key: str, body: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(body)

    _write_results(put, "", batch, tmp_path / "spool.jsonl", IDS)
    # jobs of this batch id sent by another tool, not in the manifest
    extra = write_spool(tmp_path / "x.jsonl", [completion_job(c) for c in ("x1", "x2")])
    for line in extra.read_text().splitlines():
        job = parse_job(line.encode()).job
        assert job is not None
        put(result_key("", batch, job.custom_id), dumps(success_record(job, _output(job), "e")))
    status = _status(capsys, "--from", results, "--batch-id", batch)
    assert status["request_counts"] == {"total": 12, "completed": 10, "failed": 2}
    assert status["unexpected"] == 2 and status["status"] == "completed"
    validate_batch(status)


@pytest.mark.parametrize("to", ["kafka://127.0.0.1:1/jobs", "sqs://jobs-q19"])
def test_produce_to_a_queue_needs_the_results_location_and_sends_nothing_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    to: str,
) -> None:
    # Regression: the manifest went to this machine's ./results; `status` against the
    # workers' bucket then found no batch. Nothing listens at the target: failing before
    # sending anything is the point.
    monkeypatch.delenv("QWORKER_SINK", raising=False)
    monkeypatch.chdir(tmp_path)
    spool = write_spool(tmp_path / "in.jsonl", [completion_job("a")])
    assert main(["produce", "-i", str(spool), "--to", to]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qworker produce: ") and len(err.strip().splitlines()) == 1, err
    assert "--results" in err and "QWORKER_SINK" in err, err
    assert not (tmp_path / "results").exists()


def test_produce_to_a_spool_file_keeps_the_local_results_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QWORKER_SINK", raising=False)
    monkeypatch.chdir(tmp_path)
    spool = write_spool(tmp_path / "in.jsonl", [completion_job("a")])
    assert main(["produce", "-i", str(spool), "--to", f"file://{tmp_path}/s.jsonl",
                 "--batch-id", "local"]) == 0
    assert (tmp_path / "results" / "local" / "_manifest.json").is_file()


def test_status_of_a_batch_without_a_manifest_is_one_line_and_collect_still_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "results"

    def put(key: str, body: bytes) -> None:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(body)

    spool = write_spool(tmp_path / "in.jsonl", [completion_job(c, f"p-{c}") for c in IDS[:3]])
    _write_results(put, "", "nomanifest", spool, IDS[:3])
    capsys.readouterr()
    assert main(["status", "--from", f"file://{root}", "--batch-id", "nomanifest"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("qworker status: "), captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert "has no manifest" in captured.err and "--results" in captured.err
    assert "3 results stored" in captured.err
    assert json.loads(captured.out)["request_counts"]["total"] == 3
    out = tmp_path / "collected.jsonl"
    assert main(["collect", "--from", f"file://{root}", "--batch-id", "nomanifest", "-o",
                 str(out), "--no-progress"]) == 0
    assert len(out.read_text().splitlines()) == 3
    warning = [line for line in capsys.readouterr().err.splitlines() if "no manifest" in line]
    assert len(warning) == 1 and "warning" in warning[0], warning
