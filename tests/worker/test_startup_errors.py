"""A configuration problem found at start is one clear line and exit 1, never a traceback.

Regression: a missing queue printed a 50-line traceback (and exited 1 only by accident
of the interpreter); a missing topic waited forever. Real servers (moto, tansu).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("aiokafka")

from qworker.cli import main


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", "--metrics-port", "0", "--spot-metadata-url", "", "--until-idle", "1",
                 *args])
    return code, capsys.readouterr().err


def _one_clear_line(err: str, *needles: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if " ERROR " in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_missing_sqs_queue_exits_1_with_one_line(
    tmp_path: Path, moto_server: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWORKER_SQS_ENDPOINT_URL", moto_server)
    code, err = _run(capsys, "--source", "sqs://no-such-queue-qworker", "--sink",
                     f"file://{tmp_path}/out", "--model", "echo://")
    assert code == 1
    _one_clear_line(err, "no-such-queue-qworker", "does not exist")


def test_a_missing_bucket_exits_1_with_one_line(
    tmp_path: Path, moto_server: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWORKER_S3_ENDPOINT_URL", moto_server)
    (tmp_path / "jobs.jsonl").write_text("")
    code, err = _run(capsys, "--source", f"file://{tmp_path}/jobs.jsonl", "--sink",
                     "s3://no-such-bucket-qworker/out", "--model", "echo://")
    assert code == 1
    _one_clear_line(err, "no-such-bucket-qworker")


def test_a_missing_kafka_topic_exits_1_with_one_line(
    tmp_path: Path, kafka_broker: str, capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _run(capsys, "--source", f"kafka://{kafka_broker}/no-such-topic-qworker?group=g",
                     "--sink", f"file://{tmp_path}/out", "--model", "echo://")
    assert code == 1
    _one_clear_line(err, "no-such-topic-qworker", "does not exist")


def test_a_model_that_cannot_load_exits_1_with_one_line(
    tmp_path: Path, moto_server: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    (tmp_path / "jobs.jsonl").write_text("")
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    for model in (str(tmp_path / "nowhere"), str(broken), "s3://no-such-bucket-qworker/m"):
        code, err = _run(capsys, "--source", f"file://{tmp_path}/jobs.jsonl", "--sink",
                         f"file://{tmp_path}/out", "--model", model)
        assert code == 1, err
        _one_clear_line(err, "cannot load model")
