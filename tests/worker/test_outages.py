"""Source and dead-letter outages: ridden out within the budget, then exit 69; nothing lost.

Regressions: an SQS/Kafka outage looked like an idle queue (poll errors were logged,
``receive`` returned nothing, ``--until-idle`` exited 0); a failed dead-letter send was
never retried (the SQS message stayed invisible for the life of the process, the Kafka
watermark stuck). Real servers: moto behind the fault proxy, a private tansu broker.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")
pytest.importorskip("aiokafka")
pytest.importorskip("pydantic_settings")

from qworker.config import WorkerSettings
from qworker.testing.faultproxy import FaultProxy
from qworker.worker.aws import ClientOptions, make_client
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.base import Source
from qworker.worker.sources.sqs import SqsSource
from qworker.worker.worker import Worker
from tests.fixtures.servers import QueueInfo, _stop, _wait_for_port, boto_client, free_port
from tests.fixtures.servers import tansu_binary as _tansu
from tests.worker.jobs import chat_job, read_results


def _settings(tmp_path: Path, source: str, **kw: Any) -> WorkerSettings:
    base = {"source": source, "sink": f"file://{tmp_path}/out", "model": "echo://?delay_ms=5",
            "until_idle": 0.5, "metrics_port": 0, "spot_metadata_url": ""}
    return WorkerSettings(**{**base, **kw})


def _fill(endpoint: str, url: str, bodies: list[Any]) -> None:
    sqs = boto_client("sqs", endpoint)
    for body in bodies:
        sqs.send_message(QueueUrl=url, MessageBody=body if isinstance(body, str)
                         else json.dumps(body))


def _sqs(endpoint: str, url: str, **kw: Any) -> SqsSource:
    client = make_client("sqs", ClientOptions(endpoint_url=endpoint, read_timeout=5,
                                              connect_timeout=1, max_attempts=1))
    return SqsSource(client, url, visibility_timeout=30, long_poll_seconds=1, **kw)


async def _serve(settings: WorkerSettings, source: Source, out: Path,
                 metrics: WorkerMetrics | None = None) -> tuple[Worker, float]:
    worker = Worker(settings, EchoEngine(delay_ms=5), source, FileSink(out), metrics=metrics)
    started = time.monotonic()
    await asyncio.wait_for(worker.run(), 90)
    return worker, time.monotonic() - started


def _sampler(metrics: WorkerMetrics, seen: list[str]) -> Callable[[], Any]:
    async def sample() -> None:
        while True:
            seen.extend(metrics.problems)
            await asyncio.sleep(0.1)

    return sample


def _counts(endpoint: str, url: str) -> tuple[int, int]:
    attrs = boto_client("sqs", endpoint).get_queue_attributes(
        QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return int(attrs["ApproximateNumberOfMessages"]), int(
        attrs["ApproximateNumberOfMessagesNotVisible"])


def test_an_sqs_outage_mid_run_is_ridden_out_never_taken_for_idle(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue()
    _fill(moto_server, queue.url, [chat_job(f"a{i}") for i in range(3)])
    metrics = WorkerMetrics()
    seen: list[str] = []
    with FaultProxy(moto_server) as proxy:
        async def main() -> tuple[Worker, float]:
            source = _sqs(proxy.url, queue.url)
            sampler = asyncio.create_task(_sampler(metrics, seen)())

            async def outage() -> None:
                while len(read_results(tmp_path / "out")) < 3:
                    await asyncio.sleep(0.05)
                proxy.configure(error_rate=1.0)  # SQS answers 500s for 4 s
                await asyncio.sleep(0.5)
                _fill(moto_server, queue.url, [chat_job(f"b{i}") for i in range(3)])
                await asyncio.sleep(3.5)
                proxy.configure(error_rate=0.0)

            chaos = asyncio.create_task(outage())
            try:
                return await _serve(_settings(tmp_path, f"sqs://{queue.url}"), source,
                                    tmp_path / "out", metrics)
            finally:
                sampler.cancel()
                await chaos

        worker, took = asyncio.run(main())
    assert worker.exit_code == 0 and took >= 4  # not "idle" during the outage
    assert set(read_results(tmp_path / "out")) == {f"a{i}" for i in range(3)} | {
        f"b{i}" for i in range(3)}
    assert "source" in seen  # /healthz and /readyz failed meanwhile
    assert _counts(moto_server, queue.url) == (0, 0)


def test_an_sqs_outage_past_the_budget_exits_69_and_loses_nothing(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue()
    _fill(moto_server, queue.url, [chat_job("c1")])
    with FaultProxy(moto_server, error_rate=1.0) as proxy:
        worker, took = asyncio.run(_serve(
            _settings(tmp_path, f"sqs://{queue.url}", source_outage_seconds=2.0,
                      until_idle=None), _sqs(proxy.url, queue.url), tmp_path / "out"))
        assert proxy.stats["requests"] > 0
    assert worker.exit_code == 69 and 2 <= took < 15
    assert read_results(tmp_path / "out") == {}
    assert _counts(moto_server, queue.url) == (1, 0)  # still there for the next worker


def test_a_configured_sqs_dead_letter_queue_that_does_not_exist_is_exit_1_at_start(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    # Regression: a missing DLQ was found only when the first poison message came, then
    # retried as an outage for the whole budget (exit 69, and again on every restart).
    from qworker.worker.failures import StartupError

    queue = sqs_queue()
    dlq_url = queue.url.rsplit("/", 1)[0] + "/never-created-dlq"
    _fill(moto_server, queue.url, [chat_job("ok1")])
    with pytest.raises(StartupError, match=r"dead-letter queue .*never-created-dlq.* does not"):
        asyncio.run(_serve(_settings(tmp_path, f"sqs://{queue.url}"),
                           _sqs(moto_server, queue.url, dlq_url=dlq_url), tmp_path / "out"))
    assert read_results(tmp_path / "out") == {}
    assert _counts(moto_server, queue.url) == (1, 0)  # untouched for a fixed worker


async def _poison_once_serving(tmp_path: Path, moto_server: str, queue: QueueInfo,
                               dlq_name: str, recreate_after: float | None,
                               **settings: Any) -> tuple[Worker, float]:
    """Serve ``queue``; once serving, delete the DLQ, send a poison message, and recreate
    the DLQ ``recreate_after`` seconds later (None: never)."""
    sqs = boto_client("sqs", moto_server)
    dlq_url = sqs.create_queue(QueueName=dlq_name)["QueueUrl"]
    _fill(moto_server, queue.url, [chat_job("ok1")])

    async def outage() -> None:
        while not read_results(tmp_path / "out"):
            await asyncio.sleep(0.05)
        sqs.delete_queue(QueueUrl=dlq_url)
        _fill(moto_server, queue.url, ["not json at all"])
        if recreate_after is not None:
            await asyncio.sleep(recreate_after)
            sqs.create_queue(QueueName=dlq_name)

    chaos = asyncio.create_task(outage())
    try:
        return await _serve(_settings(tmp_path, f"sqs://{queue.url}", **settings),
                            _sqs(moto_server, queue.url, dlq_url=dlq_url), tmp_path / "out")
    finally:
        await chaos


def test_an_sqs_dead_letter_queue_gone_mid_run_is_retried_until_it_is_back(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue()
    dlq_name = f"{queue.name}-late-dlq"
    worker, took = asyncio.run(_poison_once_serving(tmp_path, moto_server, queue, dlq_name,
                                                    recreate_after=2.5))
    assert worker.exit_code == 0 and took >= 2.5
    assert set(read_results(tmp_path / "out")) == {"ok1"}
    assert worker.summary.dead_lettered == 1 and worker.summary.dead_lettered_to_sink == 0
    sqs = boto_client("sqs", moto_server)
    dlq_url = sqs.get_queue_url(QueueName=dlq_name)["QueueUrl"]
    got = sqs.receive_message(QueueUrl=dlq_url, WaitTimeSeconds=1).get("Messages", [])
    assert [m["Body"] for m in got] == ["not json at all"]
    assert _counts(moto_server, queue.url) == (0, 0)


def test_a_dead_letter_target_gone_past_the_budget_exits_69_and_releases_the_message(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo]
) -> None:
    queue = sqs_queue(visibility=300)  # a held message would stay hidden for 5 minutes
    worker, took = asyncio.run(_poison_once_serving(
        tmp_path, moto_server, queue, f"{queue.name}-gone-dlq", recreate_after=None,
        source_outage_seconds=2.0))
    assert worker.exit_code == 69 and took < 20
    assert _counts(moto_server, queue.url) == (1, 0)  # visible again, not held invisible


def test_a_kafka_broker_outage_past_the_budget_exits_69(tmp_path: Path) -> None:
    from qworker.worker.sources.kafka import KafkaSource, produce
    from tests.fixtures.servers import create_topic

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    broker = subprocess.Popen(
        [str(_tansu()), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/", "--silent"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bootstrap = f"127.0.0.1:{port}"
    try:
        _wait_for_port(port, broker, timeout=20)
        create_topic(bootstrap, "jobs", 1)
        items = [(f"k{i}", json.dumps(chat_job(f"k{i}")).encode()) for i in range(3)]
        asyncio.run(produce(f"kafka://{bootstrap}/jobs", items, None))

        async def main() -> tuple[Worker, float, float]:
            source = KafkaSource(bootstrap, "jobs", "outage", session_timeout_ms=3000,
                                 commit_interval=0.2, request_timeout=5, start_wait=2)
            source.liveness_interval = 0.5
            killed: list[float] = []

            async def kill_when_done() -> None:
                while len(read_results(tmp_path / "out")) < 3:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # the commit lands
                broker.kill()
                killed.append(time.monotonic())

            chaos = asyncio.create_task(kill_when_done())
            worker, _ = await _serve(
                _settings(tmp_path, f"kafka://{bootstrap}/jobs?group=outage",
                          source_outage_seconds=2.0, until_idle=None),
                source, tmp_path / "out")
            await chaos
            return worker, time.monotonic(), killed[0]

        worker, ended, killed_at = asyncio.run(main())
    finally:
        _stop(broker)
    assert set(read_results(tmp_path / "out")) == {"k0", "k1", "k2"}
    assert worker.exit_code == 69
    assert ended - killed_at < 30


def test_a_source_that_cannot_go_on_exits_69_at_once(tmp_path: Path) -> None:
    # What the Kafka source raises for a batch it cannot decode (KafkaDecodeError): no
    # retries, no waiting out the outage budget.
    from qworker.worker.failures import SourceUnavailableError
    from qworker.worker.sources.file import FileSource
    from tests.worker.jobs import write_spool

    class Undecodable(SourceUnavailableError):
        fatal = True

    class _Source(FileSource):
        async def receive(self, max_messages: int, timeout: float) -> list:
            raise Undecodable("cannot decode a batch: unknown codec 7")

    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job("x")])
    worker, took = asyncio.run(_serve(
        _settings(tmp_path, f"file://{spool}", until_idle=None), _Source(spool),
        tmp_path / "out"))
    assert worker.exit_code == 69 and took < 5
