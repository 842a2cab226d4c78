"""The README walkthrough, end to end, as a new user runs it (processes, not imports).

A tansu broker behind ``python -m qworker.testing.kafka_edge`` (TLS + SASL/SCRAM-SHA-512,
the shape of an Amazon MSK listener), moto for S3, and the echo engine. The user sets
only ``QWORKER_*`` variables, produces ``examples/requests.jsonl`` with lz4, starts
``qworker run``, watches ``qworker status --wait`` reach ``completed``, and collects
files whose every line the openai SDK's types accept, in input order.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("aiokafka")
pytest.importorskip("boto3")
pytest.importorskip("cryptography")

from tests.fixtures.servers import boto_client, free_port, running, tansu_broker
from tests.schema.openai_types import validate_batch, validate_line

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "requests.jsonl"


def _qworker(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qworker", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _topic_is_lz4(bootstrap: str, topic: str, options: dict[str, object]) -> bool:
    """True when the topic's batches need lz4: a consumer without the codec cannot read them."""
    import aiokafka.codec
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import UnsupportedCodecError

    async def go() -> bool:
        saved = aiokafka.codec.cramjam
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id="lz4-check",
                                    auto_offset_reset="earliest", **options)
        await consumer.start()
        aiokafka.codec.cramjam = None
        try:
            for _ in range(20):
                try:
                    await consumer.getmany(timeout_ms=500)
                except UnsupportedCodecError as exc:
                    return "lz4" in str(exc)
            return False
        finally:
            aiokafka.codec.cramjam = saved
            await consumer.stop()

    return asyncio.run(go())


def test_secured_kafka_lz4_to_completed_status_and_openai_files(
    tmp_path: Path, moto_server: str, s3_bucket: str
) -> None:
    edge_port = free_port()
    tls_dir = tmp_path / "tls"
    with tansu_broker(advertised_port=edge_port) as upstream:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "XDG_CACHE_HOME": str(tmp_path / "cache")}
        edge_cmd = [sys.executable, "-m", "qworker.testing.kafka_edge", "--upstream", upstream,
                    "--port", str(edge_port), "--tls-dir", str(tls_dir),
                    "--scram-user", "alice:wonderland"]
        with running(edge_cmd, env, tmp_path / "edge.log"):
            _wait_for(tls_dir / "ca.pem")
            time.sleep(0.5)  # the edge listens right after writing its certificate
            # What the README tells the user to export:
            env.update({
                "QWORKER_S3_ENDPOINT_URL": moto_server,
                "QWORKER_SINK": f"s3://{s3_bucket}/results",
                "QWORKER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                "QWORKER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                "QWORKER_KAFKA_SASL_USERNAME": "alice",
                "QWORKER_KAFKA_SASL_PASSWORD": "wonderland",
                "QWORKER_KAFKA_SSL_CAFILE": str(tls_dir / "ca.pem"),
                "QWORKER_METRICS_PORT": "0",
                "QWORKER_SPOT_METADATA_URL": "",
            })
            bootstrap = f"127.0.0.1:{edge_port}"
            produced = _qworker("produce", "-i", str(EXAMPLES), "--to",
                                f"kafka://{bootstrap}/jobs", "--kafka-compression", "lz4",
                                "--allow-mixed", env=env)
            assert produced.returncode == 0, produced.stderr
            batch = produced.stdout.strip()
            assert batch.startswith("batch_")

            from qworker.config import WorkerSettings
            from qworker.worker.sources.kafka_client import KafkaSecurity

            security = KafkaSecurity.from_settings(WorkerSettings(
                kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="SCRAM-SHA-512",
                kafka_sasl_username="alice", kafka_sasl_password="wonderland",
                kafka_ssl_cafile=str(tls_dir / "ca.pem")))
            assert _topic_is_lz4(bootstrap, "jobs", security.client_options())

            run_cmd = [sys.executable, "-m", "qworker", "run", "--source",
                       f"kafka://{bootstrap}/jobs?group=demo", "--model", "echo://",
                       "--model-aliases", "smollm2",  # echo stands in for the jobs' model
                       "--kafka-session-timeout-ms", "3000", "--until-idle", "5"]
            with running(run_cmd, env, tmp_path / "run.log") as worker:
                status = _qworker("status", "--from", f"s3://{s3_bucket}/results",
                                  "--batch-id", batch, "--wait", "1", "--timeout", "150",
                                  env=env, timeout=200)
                assert status.returncode == 0, status.stderr + (tmp_path / "run.log").read_text()
                worker.wait(timeout=60)
                assert worker.returncode == 0, (tmp_path / "run.log").read_text()
    state = json.loads(status.stdout)
    validate_batch(state)
    ids = [json.loads(line)["custom_id"] for line in EXAMPLES.read_text().splitlines()]
    assert state["status"] == "completed" and state["missing"] == []
    assert state["request_counts"] == {"total": len(ids), "completed": len(ids), "failed": 0}

    collected = _qworker("collect", "--from", f"s3://{s3_bucket}/results", "--batch-id", batch,
                         "-o", str(tmp_path / "results.jsonl"), "--errors",
                         str(tmp_path / "errors.jsonl"), env=env)
    assert collected.returncode == 0, collected.stderr
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in lines] == ids
    assert all(validate_line(r) in ("chat", "completion") for r in lines)
    assert all(r["batch_id"] == batch and r["response"]["body"]["model"] == "echo"
               for r in lines)
    assert (tmp_path / "errors.jsonl").read_text() == ""
    s3 = boto_client("s3", moto_server)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert f"results/{batch}/_manifest.json" in keys
