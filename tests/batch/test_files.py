"""-i / -o as local paths or s3:// objects (moto), and generate --resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("boto3")

from qworker.batch.files import done_ids, open_input, open_output
from qworker.cli import main
from qworker.config import WorkerSettings
from tests.fixtures.servers import boto_client
from tests.worker.jobs import completion_job, write_spool


def test_s3_output_appears_only_when_the_block_succeeds(
    moto_server: str, s3_bucket: str
) -> None:
    settings = WorkerSettings(s3_endpoint_url=moto_server)
    uri = f"s3://{s3_bucket}/x/out.jsonl"
    with pytest.raises(RuntimeError), open_output(uri, settings) as out:
        out.write(b"half")
        raise RuntimeError("killed")
    s3 = boto_client("s3", moto_server)
    assert s3.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    with open_output(uri, settings) as out:
        out.write(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_')  # a cut last line
    with open_input(uri, settings) as f:
        assert f.read().startswith(b'{"custom_id": "a"}')
    assert done_ids(uri, settings) == ({"a", "b"}, set())
    with open_output(uri, settings, append=True) as out:
        out.write(b'{"custom_id": "c"}\n')
    body = s3.get_object(Bucket=s3_bucket, Key="x/out.jsonl")["Body"].read()
    assert body == b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c"}\n'


def test_missing_s3_input_is_a_clear_error(
    moto_server: str, s3_bucket: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWORKER_S3_ENDPOINT_URL", moto_server)
    code = main(["generate", "-i", f"s3://{s3_bucket}/nope.jsonl", "-o", "/dev/null",
                 "--model", "echo://"])
    assert code == 1
    assert f"s3://{s3_bucket}/nope.jsonl does not exist" in capsys.readouterr().err


def test_generate_reads_and_writes_s3_and_resumes(
    tmp_path: Path, moto_server: str, s3_bucket: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QWORKER_S3_ENDPOINT_URL", moto_server)
    s3 = boto_client("s3", moto_server)
    lines = [completion_job(f"g{i}", f"prompt {i}") for i in range(6)]
    spool = write_spool(tmp_path / "in.jsonl", [*lines[:3], "not json", *lines[3:]])
    s3.upload_file(str(spool), s3_bucket, "in/requests.jsonl")
    # An earlier run that was killed after three lines (the third cut short).
    partial = "\n".join(json.dumps({"custom_id": f"g{i}", "response": {"status_code": 200},
                                    "error": None}) for i in range(2))
    s3.put_object(Bucket=s3_bucket, Key="out/results.jsonl",
                  Body=(partial + '\n{"custom_id": "g2", "resp').encode())
    out_uri = f"s3://{s3_bucket}/out/results.jsonl"
    assert main(["generate", "-i", f"s3://{s3_bucket}/in/requests.jsonl", "-o", out_uri,
                 "--model", "echo://", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resuming: 2 lines already in" in err
    assert "2 already done" in err and "generate: 7/7 done" in err
    body = s3.get_object(Bucket=s3_bucket, Key="out/results.jsonl")["Body"].read()
    ids = [json.loads(x)["custom_id"] for x in body.splitlines()]
    assert ids == ["g0", "g1", "g2", None, "g3", "g4", "g5"]
    # and once more: everything is there, nothing is run or written again
    assert main(["generate", "-i", f"s3://{s3_bucket}/in/requests.jsonl", "-o", out_uri,
                 "--model", "echo://", "--resume"]) == 0
    again = s3.get_object(Bucket=s3_bucket, Key="out/results.jsonl")["Body"].read()
    assert again == body
    assert "7 already done" in capsys.readouterr().err
