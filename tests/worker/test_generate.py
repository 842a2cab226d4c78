"""``qworker generate`` output handling (qworker/worker/generate.py, qworker/cli.py).

Regressions: ``generate -o s3://missing-bucket/...`` ran the whole batch, then deleted
its temporary output with a traceback: the results were lost. Now the output is
checked before the model loads, and a final upload that fails keeps the local results
file and names it (exit 1). Real S3: moto, behind the fault proxy for a failing upload.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

from qworker.testing.faultproxy import FaultProxy
from tests.fixtures.servers import boto_client
from tests.worker.jobs import chat_job, write_spool


def _generate(tmp_path: Path, output: str, endpoint: str, env: dict[str, str]) -> Any:
    spool = write_spool(tmp_path / "in.jsonl", [chat_job(f"g{i}") for i in range(5)])
    return subprocess.run(
        [sys.executable, "-m", "qworker", "generate", "-i", str(spool), "-o", output,
         "--model", "echo://", "--s3-endpoint-url", endpoint],
        capture_output=True, text=True, timeout=120, env=env)


def test_a_missing_output_bucket_is_one_line_and_exit_1_before_any_work(
    tmp_path: Path, moto_server: str, aws_env: dict[str, str],
) -> None:
    done = _generate(tmp_path, "s3://no-such-bucket-here/out/results.jsonl", moto_server,
                     aws_env)
    assert done.returncode == 1
    assert "output bucket 'no-such-bucket-here'" in done.stderr and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr and "loading model" not in done.stderr


def test_a_failed_final_upload_keeps_the_results_and_says_where(
    tmp_path: Path, moto_server: str, s3_bucket: str, aws_env: dict[str, str],
) -> None:
    with FaultProxy(moto_server) as proxy:
        proxy.configure(error_rate=1.0, fail_methods={"PUT", "POST"})  # reads pass, writes fail
        done = _generate(tmp_path, f"s3://{s3_bucket}/out/results.jsonl", proxy.url, aws_env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    line = [x for x in done.stderr.splitlines() if "they are kept in" in x]
    assert line, done.stderr
    kept = Path(line[0].rsplit("they are kept in ", 1)[1].strip())
    try:
        records = [json.loads(x) for x in kept.read_text().splitlines()]
        assert [r["custom_id"] for r in records] == [f"g{i}" for i in range(5)]
    finally:
        kept.unlink(missing_ok=True)
    listing = boto_client("s3", moto_server).list_objects_v2(Bucket=s3_bucket)
    assert listing.get("KeyCount", 0) == 0
