"""End to end through real servers: ``qworker produce`` -> Kafka/SQS -> ``qworker run`` -> S3.

Each test drives the CLI as subprocesses (the echo engine stands in for the model) and
checks the delivery guarantees of docs/formats.md on what lands in S3 and in the queues:
every job ends with exactly one result object, kills and drains lose nothing, and
malformed messages become error records or dead letters while the worker keeps going.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiokafka")
pytest.importorskip("boto3")

from qworker.schema import error_of, result_key
from qworker.schema.keys import manifest_key
from tests.fixtures.servers import QueueInfo, boto_client, running

BATCH = "e2e"
PREFIX = "out"


def _job(i: int, content: str | None = None) -> dict[str, Any]:
    return {
        "custom_id": f"job-{i:03d}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "echo",
            "messages": [{"role": "user", "content": content or f"hello {i}"}],
            "max_tokens": 8,
            "temperature": 0,
        },
    }


def _write_jobs(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _good_jobs(n: int) -> list[bytes]:
    return [json.dumps(_job(i)).encode() for i in range(n)]


def _env(aws_env: dict[str, str], **extra: str) -> dict[str, str]:
    env = dict(aws_env)
    env.update(
        QWORKER_MODEL="echo://",
        QWORKER_METRICS_PORT="0",
        QWORKER_SPOT_METADATA_URL="",
        QWORKER_KAFKA_SESSION_TIMEOUT_MS="3000",
        QWORKER_KAFKA_COMMIT_INTERVAL_SECONDS="0.2",
        QWORKER_LOG_LEVEL="INFO",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def _qworker(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qworker", *args], env=env, capture_output=True, timeout=timeout
    )


def _produce_fast(source: str, jobs: Path, endpoint: str) -> None:
    """Push ``jobs`` in-process (the CLI path is covered by the first two tests)."""
    from types import SimpleNamespace

    from qworker.worker.sources import kafka, sqs

    items = []
    for line in jobs.read_bytes().splitlines():
        data = json.loads(line)
        data["batch_id"] = BATCH
        items.append((data["custom_id"], json.dumps(data).encode()))
    module = kafka if source.startswith("kafka://") else sqs
    settings = SimpleNamespace(sqs_endpoint_url=endpoint, aws_region="us-east-1")
    assert asyncio.run(module.produce(source, items, settings)) == len(items)


def _run_cmd(source: str, sink: str, until_idle: float = 1.0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qworker",
        "run",
        "--source",
        source,
        "--sink",
        sink,
        "--until-idle",
        str(until_idle),
    ]


def _objects(endpoint: str, bucket: str) -> dict[str, bytes]:
    s3 = boto_client("s3", endpoint)
    out: dict[str, bytes] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def _count(endpoint: str, bucket: str) -> int:
    resp = boto_client("s3", endpoint).list_objects_v2(Bucket=bucket)
    return int(resp.get("KeyCount", 0))


def _assert_one_valid_result_per_job(
    endpoint: str, bucket: str, ids: list[str], errors: dict[str, str] | None = None
) -> None:
    """Exactly the expected keys exist; each holds a well-formed record for its job."""
    errors = errors or {}
    objects = _objects(endpoint, bucket)
    objects.pop(manifest_key(PREFIX, BATCH), None)  # written by produce --results, not a result
    expected = {result_key(PREFIX, BATCH, cid): cid for cid in ids}
    assert set(objects) == set(expected), (
        f"missing {sorted(set(expected) - set(objects))[:5]}, "
        f"extra {sorted(set(objects) - set(expected))[:5]}"
    )
    for key, body in objects.items():
        record = json.loads(body)
        cid = expected[key]
        assert record["custom_id"] == cid
        assert record["batch_id"] == BATCH
        if cid in errors:
            assert error_of(record) is not None, record
            assert error_of(record)["code"] == errors[cid], record
        else:
            assert record["error"] is None, record["error"]
            assert record["response"]["status_code"] == 200
            choice = record["response"]["body"]["choices"][0]
            assert choice["message"]["role"] == "assistant"


def _kafka_committed(broker: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def get() -> dict[int, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=broker, group_id=group)
        await consumer.start()
        try:
            return {
                p: (await consumer.committed(TopicPartition(topic, p))) or 0
                for p in range(partitions)
            }
        finally:
            await consumer.stop()

    return asyncio.run(get())


def _kafka_dlq(broker: str, topic: str, expected: int) -> list[Any]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def read() -> list[Any]:
        # Assigned partitions, no group: no join round (tansu takes ~2 s per join).
        consumer = AIOKafkaConsumer(bootstrap_servers=broker, auto_offset_reset="earliest")
        await consumer.start()
        records: list[Any] = []
        try:
            await consumer.topics()  # refreshes metadata for every topic
            parts = consumer.partitions_for_topic(f"{topic}.dlq") or set()
            consumer.assign([TopicPartition(f"{topic}.dlq", p) for p in parts])
            deadline = time.monotonic() + 10
            while len(records) < expected and time.monotonic() < deadline:
                for batch in (await consumer.getmany(timeout_ms=300)).values():
                    records += batch
        finally:
            await consumer.stop()
        return records

    return asyncio.run(read())


def _queue_counts(endpoint: str, url: str) -> tuple[int, int]:
    attrs = boto_client("sqs", endpoint).get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return (
        int(attrs["ApproximateNumberOfMessages"]),
        int(attrs["ApproximateNumberOfMessagesNotVisible"]),
    )


def _wait_for_results(endpoint: str, bucket: str, at_least: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = _count(endpoint, bucket)
        if n >= at_least:
            return n
        time.sleep(0.05)
    raise AssertionError(f"fewer than {at_least} results after {timeout}s")


def _sigterm_mid_batch(source: str, sink: str, env: dict[str, str], log: Path,
                       endpoint: str, bucket: str) -> float:
    """Run a worker until a few results exist, SIGTERM it mid-batch; return the drain's wall
    time after asserting it exited 75 (drained with work left)."""
    with running(_run_cmd(source, sink, until_idle=30), env, log) as proc:
        # Jobs of ~1 s each, 4 in flight: once 4 results exist the next ones are running
        # (an event, not a guess at how far they got).
        _wait_for_results(endpoint, bucket, at_least=4)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 75, log.read_text()[-3000:]
        return time.monotonic() - started


def _slow_env(aws_env: dict[str, str], **extra: str) -> dict[str, str]:
    """Jobs of ~1 s each, 4 in flight, a 0.3 s drain: jobs in flight at SIGTERM are abandoned."""
    return _env(aws_env, QWORKER_MODEL="echo://?delay_ms=50&steps=20",
                QWORKER_MAX_INFLIGHT_JOBS="4", QWORKER_DRAIN_SECONDS="0.3", **extra)


def _rerun_to_completion(source: str, sink: str, env: dict[str, str], log: Path) -> None:
    """Run a fresh worker until idle and assert it exited 0."""
    with running(_run_cmd(source, sink), env, log) as proc:
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]


def _malformed() -> tuple[list[bytes], dict[str, str], int]:
    """Malformed jobs: (lines, custom_id -> expected error code, number of dead letters)."""
    unknown_url = _job(900)
    unknown_url["url"] = "/v1/images/generations"
    wrong_type = _job(901)
    wrong_type["body"]["max_tokens"] = "many"
    bad_param = _job(902)
    bad_param["body"]["temperature"] = -1
    too_long = _job(903, content="x" * 5000)  # the echo engine's max_model_len is 4096
    oversized = _job(904, content="y" * 30_000)  # over QWORKER_MAX_JOB_BYTES below
    lines = [
        b"this is not json",
        b"[1, 2, 3]",
        *(
            json.dumps(j).encode()
            for j in (unknown_url, wrong_type, bad_param, too_long, oversized)
        ),
    ]
    errors = {
        "job-900": "invalid_request",
        "job-901": "invalid_request",
        "job-902": "invalid_request",
        "job-903": "context_length_exceeded",
        "job-904": "invalid_request",
    }
    return lines, errors, 2


def test_kafka_to_s3_one_result_per_job_and_malformed_ones_recorded_or_dead_lettered(
    tmp_path: Path,
    kafka_broker: str,
    kafka_topic: Callable[..., str],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    topic = kafka_topic(3)
    bad, errors, n_dead = _malformed()
    good = _good_jobs(30)
    lines = good[:10] + bad + good[10:]
    jobs = _write_jobs(tmp_path / "requests.jsonl", lines)
    env = _env(aws_env, QWORKER_MAX_JOB_BYTES="20000")
    source = f"kafka://{kafka_broker}/{topic}?group=e2e"
    sink = f"s3://{s3_bucket}/{PREFIX}"

    # a producer that allows bigger jobs than the workers do: the oversized one must still
    # get its error record from the worker (--allow-mixed: the unknown-url job is one of
    # the malformed ones)
    done = _qworker("produce", "-i", str(jobs), "--to", source, "--batch-id", BATCH,
                    "--max-job-bytes", "100000", "--results", sink, "--allow-mixed", env=env)
    assert done.returncode == 0, done.stderr.decode()
    with running(_run_cmd(source, sink), env, tmp_path / "worker.log") as proc:
        assert proc.wait(timeout=90) == 0, (tmp_path / "worker.log").read_text()[-3000:]

    ids = [f"job-{i:03d}" for i in range(30)] + list(errors)
    _assert_one_valid_result_per_job(moto_server, s3_bucket, ids, errors)
    committed = _kafka_committed(kafka_broker, "e2e", topic, 3)
    assert sum(committed.values()) == len(lines)
    dead = _kafka_dlq(kafka_broker, topic, n_dead)
    assert sorted(r.value for r in dead) == sorted([b"this is not json", b"[1, 2, 3]"])
    assert all(dict(r.headers).get("qworker-dlq-reason") for r in dead)

    out = tmp_path / "results.jsonl"
    errs = tmp_path / "errors.jsonl"
    done = _qworker(
        "collect",
        "--from",
        sink,
        "--batch-id",
        BATCH,
        "-o",
        str(out),
        "--errors",
        str(errs),
        env=env,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert len(out.read_text().splitlines()) == 30
    assert len(errs.read_text().splitlines()) == len(errors)


def test_sqs_to_s3_one_result_per_job_and_malformed_ones_recorded_or_dead_lettered(
    tmp_path: Path,
    sqs_queue: Callable[..., QueueInfo],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    queue = sqs_queue(dlq=True, max_receive_count=5)
    bad, errors, n_dead = _malformed()
    good = _good_jobs(25)
    jobs = _write_jobs(tmp_path / "requests.jsonl", good + bad)
    env = _env(aws_env, QWORKER_MAX_JOB_BYTES="20000")
    source = f"sqs://{queue.name}"
    sink = f"s3://{s3_bucket}/{PREFIX}"

    # a producer that allows bigger jobs than the workers do: the oversized one must still
    # get its error record from the worker (--allow-mixed: the unknown-url job is one of
    # the malformed ones)
    done = _qworker("produce", "-i", str(jobs), "--to", source, "--batch-id", BATCH,
                    "--max-job-bytes", "100000", "--results", sink, "--allow-mixed", env=env)
    assert done.returncode == 0, done.stderr.decode()
    with running(_run_cmd(source, sink), env, tmp_path / "worker.log") as proc:
        assert proc.wait(timeout=90) == 0, (tmp_path / "worker.log").read_text()[-3000:]

    ids = [f"job-{i:03d}" for i in range(25)] + list(errors)
    _assert_one_valid_result_per_job(moto_server, s3_bucket, ids, errors)
    assert _queue_counts(moto_server, queue.url) == (0, 0)
    assert queue.dlq_url is not None
    assert _queue_counts(moto_server, queue.dlq_url) == (n_dead, 0)


def test_kafka_worker_killed_mid_batch_and_restarted_leaves_no_job_missing(
    tmp_path: Path,
    kafka_broker: str,
    kafka_topic: Callable[..., str],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    topic = kafka_topic(2)
    n = 60
    jobs = _write_jobs(tmp_path / "requests.jsonl", _good_jobs(n))
    # 4 jobs at a time, ~0.15 s each: the batch takes a few seconds.
    slow = _env(aws_env, QWORKER_MODEL="echo://?delay_ms=30&steps=5", QWORKER_MAX_INFLIGHT_JOBS="4")
    source = f"kafka://{kafka_broker}/{topic}?group=killed"
    sink = f"s3://{s3_bucket}/{PREFIX}"
    _produce_fast(source, jobs, moto_server)

    with running(_run_cmd(source, sink, until_idle=30), slow, tmp_path / "first.log") as proc:
        _wait_for_results(moto_server, s3_bucket, at_least=8)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    written_before = _count(moto_server, s3_bucket)
    assert written_before < n, "the worker finished everything before it was killed"

    fast = _env(aws_env)
    _rerun_to_completion(source, sink, fast, tmp_path / "second.log")
    _assert_one_valid_result_per_job(moto_server, s3_bucket, [f"job-{i:03d}" for i in range(n)])
    assert sum(_kafka_committed(kafka_broker, "killed", topic, 2).values()) == n


def test_kafka_sigterm_drain_commits_only_finished_work_and_the_rest_is_redelivered(
    tmp_path: Path,
    kafka_broker: str,
    kafka_topic: Callable[..., str],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    topic = kafka_topic(1)  # one partition: offset i is job i
    n = 40
    jobs = _write_jobs(tmp_path / "requests.jsonl", _good_jobs(n))
    source = f"kafka://{kafka_broker}/{topic}?group=drained"
    sink = f"s3://{s3_bucket}/{PREFIX}"
    _produce_fast(source, jobs, moto_server)

    drain_wall = _sigterm_mid_batch(source, sink, _slow_env(aws_env), tmp_path / "first.log",
                                    moto_server, s3_bucket)
    assert drain_wall < 10

    committed = _kafka_committed(kafka_broker, "drained", topic, 1)[0]
    stored = {k for k in _objects(moto_server, s3_bucket)}
    assert 0 < committed < n
    for offset in range(committed):  # nothing below the commit lacks its result
        assert result_key(PREFIX, BATCH, f"job-{offset:03d}") in stored, offset
    assert len(stored) < n, "every job finished before the drain: nothing was redelivered"

    _rerun_to_completion(source, sink, _env(aws_env), tmp_path / "second.log")
    _assert_one_valid_result_per_job(moto_server, s3_bucket, [f"job-{i:03d}" for i in range(n)])
    assert _kafka_committed(kafka_broker, "drained", topic, 1)[0] == n


def test_sqs_sigterm_drain_makes_unfinished_jobs_visible_again_at_once(
    tmp_path: Path,
    sqs_queue: Callable[..., QueueInfo],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    queue = sqs_queue(visibility=300)  # an unreleased job would stay hidden for 5 minutes
    n = 30
    jobs = _write_jobs(tmp_path / "requests.jsonl", _good_jobs(n))
    source = f"sqs://{queue.url}"
    sink = f"s3://{s3_bucket}/{PREFIX}"
    _produce_fast(source, jobs, moto_server)

    _sigterm_mid_batch(source, sink, _slow_env(aws_env, QWORKER_SQS_VISIBILITY_TIMEOUT="300"),
                       tmp_path / "first.log", moto_server, s3_bucket)
    stored = _count(moto_server, s3_bucket)
    visible, hidden = _queue_counts(moto_server, queue.url)
    assert hidden == 0, "a drained worker left jobs invisible"
    assert visible == n - stored

    _rerun_to_completion(source, sink, _env(aws_env), tmp_path / "second.log")
    _assert_one_valid_result_per_job(moto_server, s3_bucket, [f"job-{i:03d}" for i in range(n)])
    assert _queue_counts(moto_server, queue.url) == (0, 0)


def _received(log_path: Path) -> int:
    for line in log_path.read_text().splitlines():
        if line.startswith("jobs: received "):
            return int(line.split()[2].rstrip(","))
    raise AssertionError(f"no summary in {log_path}")


def test_two_workers_in_one_group_with_a_rebalance_between_them_lose_nothing(
    tmp_path: Path,
    kafka_broker: str,
    kafka_topic: Callable[..., str],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    topic = kafka_topic(4)
    n = 80
    jobs = _write_jobs(tmp_path / "requests.jsonl", _good_jobs(n))
    slow = _env(
        aws_env, QWORKER_MODEL="echo://?delay_ms=40&steps=10", QWORKER_MAX_INFLIGHT_JOBS="4"
    )
    source = f"kafka://{kafka_broker}/{topic}?group=pair"
    sink = f"s3://{s3_bucket}/{PREFIX}"
    _produce_fast(source, jobs, moto_server)

    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    with running(_run_cmd(source, sink, until_idle=3), slow, log_a) as a:
        _wait_for_results(moto_server, s3_bucket, at_least=4)
        # B joins while A has jobs in flight: the group rebalances under load.
        with running(_run_cmd(source, sink, until_idle=3), slow, log_b) as b:
            assert b.wait(timeout=90) == 0, log_b.read_text()[-3000:]
        assert a.wait(timeout=90) == 0, log_a.read_text()[-3000:]

    _assert_one_valid_result_per_job(moto_server, s3_bucket, [f"job-{i:03d}" for i in range(n)])
    assert sum(_kafka_committed(kafka_broker, "pair", topic, 4).values()) == n
    assert _received(log_b) > 0, "the second worker never got a partition"


def test_s3_failing_with_5xx_and_resets_is_retried_through_by_the_worker(
    tmp_path: Path,
    sqs_queue: Callable[..., QueueInfo],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    from qworker.testing.faultproxy import FaultProxy

    queue = sqs_queue()
    n = 20
    jobs = _write_jobs(tmp_path / "requests.jsonl", _good_jobs(n))
    source = f"sqs://{queue.url}"
    sink = f"s3://{s3_bucket}/{PREFIX}"
    _produce_fast(source, jobs, moto_server)

    with FaultProxy(moto_server, error_rate=0.2, reset_rate=0.05, seed=3) as proxy:
        env = _env(aws_env, QWORKER_S3_ENDPOINT_URL=proxy.url)
        with running(_run_cmd(source, sink), env, tmp_path / "worker.log") as proc:
            assert proc.wait(timeout=90) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        stats = proxy.stats
    assert stats["errors_500"] + stats["errors_503"] + stats["resets"] > 0
    _assert_one_valid_result_per_job(moto_server, s3_bucket, [f"job-{i:03d}" for i in range(n)])
    assert _queue_counts(moto_server, queue.url) == (0, 0)


def test_sqs_responses_jobs_get_response_objects_and_a_wrong_model_a_404(
    tmp_path: Path,
    sqs_queue: Callable[..., QueueInfo],
    s3_bucket: str,
    moto_server: str,
    aws_env: dict[str, str],
) -> None:
    from tests.schema.openai_types import validate_line

    queue = sqs_queue()
    lines = [{"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "echo", "input": f"hello {i}", "instructions": "Be brief.",
                       "max_output_tokens": 64}} for i in range(3)]
    lines.append({"custom_id": "resp-other", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "gpt-4o-mini", "input": "hi"}})
    jobs = _write_jobs(tmp_path / "requests.jsonl", [json.dumps(j).encode() for j in lines])
    source = f"sqs://{queue.name}"
    _produce_fast(source, jobs, moto_server)
    with running(_run_cmd(source, f"s3://{s3_bucket}/{PREFIX}"), _env(aws_env),
                 tmp_path / "worker.log") as proc:
        assert proc.wait(timeout=90) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    objects = _objects(moto_server, s3_bucket)
    records = {cid: json.loads(objects[result_key(PREFIX, BATCH, cid)])
               for cid in (j["custom_id"] for j in lines)}
    for i in range(3):
        record = records[f"resp-{i}"]
        assert validate_line(record) == "response"
        body = record["response"]["body"]
        assert body["status"] == "completed" and body["model"] == "echo"
        assert f"hello {i}" in body["output"][0]["content"][0]["text"]  # the echo engine
    assert validate_line(records["resp-other"]) == "404"
    assert error_of(records["resp-other"])["code"] == "model_not_found"
