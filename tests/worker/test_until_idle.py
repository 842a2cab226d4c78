"""``--until-idle`` exits 0 only when nothing is in flight AND the source has no pending work.

Regression for a restarted ``--until-idle`` worker that exited 0 after a few quiet
seconds while the messages a killed worker held were still invisible (SQS) or still
uncommitted on partitions the dead member kept until its session expired (Kafka): an
AWS Batch array finished with work left. Real servers: moto and the tansu broker.
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

pytest.importorskip("boto3")
pytest.importorskip("aiokafka")
pytest.importorskip("pydantic_settings")

from qworker.config import WorkerSettings
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.base import Source
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.fixtures.servers import QueueInfo, boto_client
from tests.worker.jobs import chat_job, read_results, write_spool


def _settings(tmp_path: Path, source: str, **kw: Any) -> WorkerSettings:
    base = {"source": source, "sink": f"file://{tmp_path}/out", "model": "echo://",
            "until_idle": 0.5, "metrics_port": 0, "spot_metadata_url": ""}
    return WorkerSettings(**{**base, **kw})


async def _serve(settings: WorkerSettings, source: Source, out: Path) -> tuple[Worker, float]:
    worker = Worker(settings, EchoEngine(), source, FileSink(out))
    started = time.monotonic()
    await asyncio.wait_for(worker.run(), 90)
    return worker, time.monotonic() - started


def test_sqs_messages_a_killed_worker_holds_keep_an_until_idle_worker_serving(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    from qworker.worker.aws import ClientOptions, make_client
    from qworker.worker.sources.sqs import SqsSource

    queue = sqs_queue(visibility=30)
    sqs = boto_client("sqs", moto_server)
    for i in range(5):
        sqs.send_message(QueueUrl=queue.url, MessageBody=json.dumps(chat_job(f"held-{i}")))
    # The "killed worker": received everything, will never delete or release it.
    held = 0
    while held < 5:
        held += len(sqs.receive_message(QueueUrl=queue.url, MaxNumberOfMessages=10,
                                        VisibilityTimeout=4).get("Messages", []))

    client = make_client("sqs", ClientOptions(endpoint_url=moto_server))
    source = SqsSource(client, queue.url, visibility_timeout=30, long_poll_seconds=1)
    settings = _settings(tmp_path, f"sqs://{queue.url}")
    worker, took = asyncio.run(_serve(settings, source, tmp_path / "out"))

    assert set(read_results(tmp_path / "out")) == {f"held-{i}" for i in range(5)}
    assert worker.exit_code == 0 and worker.summary.drain_reason == "idle"
    assert took >= 3  # it waited for the held messages to become visible again
    attrs = sqs.get_queue_attributes(QueueUrl=queue.url, AttributeNames=["All"])["Attributes"]
    assert attrs["ApproximateNumberOfMessages"] == attrs[
        "ApproximateNumberOfMessagesNotVisible"] == "0"


_HOLDER = """
import asyncio, sys
from qworker.worker.sources.kafka import KafkaSource

async def main():
    src = KafkaSource(sys.argv[1], sys.argv[2], sys.argv[3], session_timeout_ms=3000,
                      commit_interval=0.2)
    await src.start()
    got = 0
    while got < int(sys.argv[4]):
        got += len(await src.receive(100, 0.5))
    print("held", got, flush=True)
    await asyncio.sleep(3600)  # never acks; SIGKILLed by the test

asyncio.run(main())
"""


def test_kafka_partitions_a_killed_member_held_keep_an_until_idle_worker_serving(
    tmp_path: Path, kafka_broker: str, kafka_topic: Callable[..., str]
) -> None:
    from qworker.worker.sources.kafka import KafkaSource, produce

    topic = kafka_topic(2)
    n = 6
    items = [(f"k-{i}", json.dumps(chat_job(f"k-{i}")).encode()) for i in range(n)]
    assert asyncio.run(produce(f"kafka://{kafka_broker}/{topic}", items, None)) == n
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, kafka_broker, topic, "idle", str(n)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().startswith("held"), "the holder never got the jobs"

        async def main() -> tuple[Worker, float]:
            source = KafkaSource(kafka_broker, topic, "idle", session_timeout_ms=3000,
                                 commit_interval=0.2, start_wait=1.0)
            # The other member dies without leaving the group once this one is quiet.
            asyncio.get_running_loop().call_later(3.0, holder.kill)
            return await _serve(_settings(tmp_path, f"kafka://{kafka_broker}/{topic}?group=idle"),
                                source, tmp_path / "out")

        worker, took = asyncio.run(main())
    finally:
        holder.kill()
        holder.wait(10)
    assert set(read_results(tmp_path / "out")) == {f"k-{i}" for i in range(n)}
    assert worker.exit_code == 0 and took >= 3


class _BlindSource(FileSource):
    """A file source whose broker cannot be asked about pending work for a while."""

    blind_until = 0.0
    asked = 0

    async def pending_work(self) -> int:
        self.asked += 1
        if time.monotonic() < self.blind_until:
            raise ConnectionError("broker unreachable")
        return await super().pending_work()


def test_a_source_that_cannot_report_pending_work_is_never_idle(tmp_path: Path) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job("f1")])
    source = _BlindSource(spool)

    async def main() -> tuple[Worker, float]:
        source.blind_until = time.monotonic() + 3
        return await _serve(_settings(tmp_path, f"file://{spool}"), source, tmp_path / "out")

    worker, took = asyncio.run(main())
    assert worker.exit_code == 0 and set(read_results(tmp_path / "out")) == {"f1"}
    assert took >= 3 and source.asked >= 2
