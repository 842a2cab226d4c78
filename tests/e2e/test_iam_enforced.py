"""The e2e paths as the deployment runs them, with the shipped IAM policies enforced.

A private moto server checks every request's signature and evaluates it against the
caller's IAM policy (``tests.fixtures.iam_moto``). The deployment's bucket and queues
exist under terraform's names; the users ``worker``, ``producer`` and ``collector``
hold exactly ``deploy/terraform/policies/{worker,producer,collector}.json.tftpl``.
As those users, in subprocesses, as an operator would:

1. ``produce`` the batch (three jobs and a line that is not JSON) to the jobs queue by
   name (GetQueueUrl), the manifest to ``s3://<bucket>/results``;
2. ``run`` the worker as Batch runs it (queue and DLQ by URL), loading the model from
   ``s3://<bucket>/models/smollm2``; once its results are stored, a redelivered copy of
   one job (412 -> HeadObject: a duplicate) and a different request under another's
   custom_id (a ``_conflicts/`` record) arrive; the worker dead-letters the non-JSON
   line to the DLQ and exits 0 once idle;
3. ``status`` and ``collect`` read the batch back;
4. ``run`` again the way a user may configure it: the queue by name (GetQueueUrl),
   the DLQ found through the queue's RedrivePolicy, a job long enough for visibility
   heartbeats (ChangeMessageVisibility).

Every AWS call the processes make is recorded (``qworker.testing.aws_calls``); the last
test of the session (here, so that it also sees this module's calls) checks every call
the whole session recorded against the shipped policies, request by request, and that
the policies allow nothing that no call needed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from tests.fixtures.aws_recording import recorded_calls
from tests.fixtures.iam import allowed_entries, check_calls, load_calls
from tests.fixtures.iam_moto import EnforcingMoto, enforcing_moto, wait_until
from tests.fixtures.iam_policies import deployment
from tests.fixtures.servers import running

ROOT = Path(__file__).resolve().parents[2]
BATCH = "nightly-iam"
#: What a worker's log says when a call was refused (a bare "403" also matched a port).
_DENIED = re.compile(r"AccessDenied|\b403 Forbidden\b|\(403\)|HTTP 403|status 403")

#: Allowed (policy, Sid, action, resource) that no code on this branch calls yet, each
#: with the change that adds the call. The least-privilege test accepts these unused;
#: once the call is recorded, the entry is reported as no longer pending.
PENDING = {
    ("producer", "WriteBatchMarkers", "s3:PutObject",
     "arn:aws:s3:::{bucket}/results/*/_failed.json"):
        "issue 20: produce marks a batch it could not finish (no test fails a produce "
        "into S3 yet)",
}


def _job(custom_id: str, text: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "messages": [{"role": "user", "content": text}],
                     "max_tokens": max_tokens, "temperature": 0}}


def _qworker(args: list[str], env: dict[str, str], timeout: float = 180) -> (
        subprocess.CompletedProcess[str]):
    return subprocess.run([sys.executable, "-m", "qworker", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _keys(moto: EnforcingMoto, prefix: str) -> list[str]:
    s3 = moto.client("s3")
    found = s3.list_objects_v2(Bucket=moto.dep.bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in found)


@pytest.fixture(scope="module")
def moto_iam(tmp_path_factory: pytest.TempPathFactory, tiny_chat_model_dir: Path) -> (
        Iterator[EnforcingMoto]):
    """The enforcing server, with the model uploaded where terraform's model_uri points."""
    log = tmp_path_factory.mktemp("moto-iam") / "moto.log"
    with enforcing_moto(log) as moto:
        s3 = moto.client("s3")
        prefix = f"{moto.dep.model_prefix}/{moto.dep.model_name}"
        for path in sorted(tiny_chat_model_dir.iterdir()):
            s3.upload_file(str(path), moto.dep.bucket, f"{prefix}/{path.name}")
        yield moto


def _worker_env(moto: EnforcingMoto, tmp: Path, **extra: str) -> dict[str, str]:
    env = moto.env("worker")
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "QWORKER_METRICS_PORT": "0",
                "QWORKER_SPOT_METADATA_URL": "", "XDG_CACHE_HOME": str(tmp / "cache"),
                "QWORKER_AWS_REGION": moto.dep.region, **extra})
    return env


def test_the_deployment_runs_end_to_end_under_the_shipped_policies(
    moto_iam: EnforcingMoto, tmp_path: Path
) -> None:
    moto, dep = moto_iam, moto_iam.dep
    sink = f"s3://{dep.bucket}/{dep.results_prefix}"
    # the users hold only their policy: a write outside it is refused (enforcement is on)
    with pytest.raises(Exception, match="AccessDenied"):
        moto.client("s3", "worker").put_object(Bucket=dep.bucket, Key="elsewhere.json",
                                               Body=b"{}")

    jobs = [_job(f"doc-{i}", f"Summarize item {i}.") for i in range(3)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(j) + "\n" for j in jobs) + "this is not json\n")
    env = moto.env("producer") | {"PYTHONPATH": str(ROOT)}
    produced = _qworker(["produce", "-i", str(requests), "--to", f"sqs://{dep.jobs_queue}",
                         "--batch-id", BATCH, "--results", sink], env)
    assert produced.returncode == 0, produced.stderr

    # 2. the worker as AWS Batch runs it (deploy/terraform/batch.tf's environment)
    # A short visibility: the worker exits with its last long poll still open, and moto
    # hands the next message to that orphaned poll; it must come back soon for step 4.
    env = _worker_env(moto, tmp_path, QWORKER_SQS_DLQ_URL=moto.dlq_url,
                      QWORKER_SQS_VISIBILITY_TIMEOUT="3")
    cmd = [sys.executable, "-m", "qworker", "run", "--source", f"sqs://{moto.jobs_url}",
           "--sink", sink, "--model", f"s3://{dep.bucket}/{dep.model_prefix}/{dep.model_name}",
           "--until-idle", "3"]
    log = tmp_path / "worker.log"
    with running(cmd, env, log) as worker:
        results = [f"{dep.results_prefix}/{BATCH}/doc-{i}.json" for i in range(3)]
        wait_until(lambda: set(results) <= set(_keys(moto, f"{dep.results_prefix}/{BATCH}/"))
                   or worker.poll() is not None, 150, "the first results")
        assert worker.poll() is None, log.read_text()
        admin = moto.client("sqs")
        redelivered = {**jobs[0], "batch_id": BATCH}
        conflicting = {**_job("doc-1", "A different request under doc-1."), "batch_id": BATCH}
        for job in (redelivered, conflicting):
            admin.send_message(QueueUrl=moto.jobs_url, MessageBody=json.dumps(job),
                               MessageAttributes={"custom_id": {
                                   "DataType": "String", "StringValue": job["custom_id"]}})
        worker.wait(timeout=120)
    output = log.read_text()
    assert worker.returncode == 0, output
    assert not _DENIED.search(output), output
    conflicts = _keys(moto, f"{dep.results_prefix}/{BATCH}/_conflicts/")
    assert len(conflicts) == 1 and "doc-1" in conflicts[0], conflicts
    dead = moto.client("sqs").receive_message(QueueUrl=moto.dlq_url, WaitTimeSeconds=1)
    assert [m["Body"] for m in dead.get("Messages", [])] == ["this is not json"]

    # 3. status and collect as the collector
    env = moto.env("collector") | {"PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    status = _qworker(["status", "--from", sink, "--batch-id", BATCH], env)
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["request_counts"]["total"] == 3 and state["request_counts"]["completed"] == 3
    collected = _qworker(["collect", "--from", sink, "--batch-id", BATCH, "-o",
                          str(tmp_path / "results.jsonl"), "--errors",
                          str(tmp_path / "errors.jsonl"), "--no-progress"], env)
    assert collected.returncode == 0, collected.stderr
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ["doc-0", "doc-1", "doc-2"]
    assert all(r["response"]["status_code"] == 200 for r in lines)
    assert "duplicate_custom_id" in (tmp_path / "errors.jsonl").read_text()

    # 4. the queue by name, the DLQ from the RedrivePolicy, a job that outlives a third
    #    of the visibility timeout (heartbeats)
    moto.client("sqs").send_message(QueueUrl=moto.jobs_url, MessageBody=json.dumps(
        {**_job("slow", "slow"), "batch_id": "slow"}))
    env = _worker_env(moto, tmp_path, QWORKER_SQS_VISIBILITY_TIMEOUT="3")
    cmd = [sys.executable, "-m", "qworker", "run", "--source", f"sqs://{dep.jobs_queue}",
           "--sink", sink, "--model", "echo://?delay_ms=600&steps=4", "--until-idle", "2",
           "--model-aliases", "smollm2"]  # the echo engine stands in for the job's model
    log = tmp_path / "worker-by-name.log"
    with running(cmd, env, log) as worker:
        try:
            worker.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(log.read_text())
    output = log.read_text()
    assert worker.returncode == 0, output
    assert not _DENIED.search(output), output
    assert f"{dep.results_prefix}/slow/slow.json" in _keys(moto, f"{dep.results_prefix}/slow/")
    calls = [c for c in load_calls(recorded_calls()) if c.operation.startswith(
        "ChangeMessageVisibility")]
    assert calls, "no visibility heartbeat was recorded"


def _pending(dep: Any) -> dict[tuple[str, str, str, str], str]:
    names = {"bucket": dep.bucket, "dlq_arn": dep.queue_arn(dep.dlq)}
    return {tuple(part.format(**names) for part in entry): why
            for entry, why in PENDING.items()}  # type: ignore[misc]


@pytest.mark.runs_last
def test_every_recorded_aws_call_is_allowed_and_every_allowed_action_is_used() -> None:
    """The session's calls (this module's and every other test's) against the policies."""
    calls = load_calls(recorded_calls())
    assert calls, "the recorder saw no AWS call: is BOTOCORE_EXPERIMENTAL__PLUGINS honoured?"
    verdict = check_calls(calls)
    assert not verdict.violations, "\n".join(sorted(set(verdict.violations)))
    pending = _pending(deployment())
    unused = allowed_entries(("worker", "producer", "collector")) - verdict.used
    assert unused <= pending.keys(), "allowed but never needed:\n" + "\n".join(
        map(str, sorted(unused - pending.keys())))
    now_used = pending.keys() & verdict.used
    if now_used:
        import warnings

        warnings.warn(f"no longer pending (remove from PENDING): {sorted(now_used)}",
                      stacklevel=1)
