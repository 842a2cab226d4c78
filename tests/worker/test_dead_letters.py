"""Dead letters (qworker/worker/dead_letters.py): never only logged, and a target that
refuses one message is not an outage.

Regressions: on SQS without a redrive policy or ``QWORKER_SQS_DLQ_URL`` a malformed
message was only logged and deleted (yet counted as dead-lettered); one message the
dead-letter target refused for good (too large for the SQS DLQ, invalid for a Kafka
DLQ topic) was retried as a dead-letter *outage*: every worker that received it exited
69, and the next one received it again. Real servers: moto, tansu (a private broker
whose DLQ topic validates records against a JSON schema, so it refuses non-objects).
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("boto3")
pytest.importorskip("aiokafka")
pytest.importorskip("pydantic_settings")

from qworker.schema import error_of
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.sinks.base import PutResult
from qworker.worker.sinks.file import FileSink
from qworker.worker.worker import Worker
from tests.fixtures.servers import QueueInfo, _stop, _wait_for_port, boto_client, free_port
from tests.fixtures.servers import tansu_binary as _tansu
from tests.worker.harness import file_source, kafka_source, serve, settings, sqs_source
from tests.worker.jobs import acked_lines, chat_job, read_results

POISON = "not a json object at all " + "#" * 2000  # over a 1,024-byte DLQ's size limit


def _queue_counts(endpoint: str, url: str) -> tuple[int, int]:
    attrs = boto_client("sqs", endpoint).get_queue_attributes(
        QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return (int(attrs["ApproximateNumberOfMessages"]),
            int(attrs["ApproximateNumberOfMessagesNotVisible"]))


def _sink_dead_letters(out: Path) -> list[dict[str, Any]]:
    folder = out / "_dead_letters"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] \
        if folder.is_dir() else []


def test_sqs_without_any_dead_letter_queue_writes_the_message_to_the_sink(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo],
) -> None:
    queue = sqs_queue()  # no RedrivePolicy, no sqs_dlq_url
    source, uri = sqs_source(moto_server, queue.url, [chat_job("ok"), "[1, 2, 3]"])
    worker = asyncio.run(serve(settings(tmp_path, uri), source, tmp_path / "out"))
    assert worker.exit_code == 0
    assert set(read_results(tmp_path / "out")) == {"ok"}
    [letter] = _sink_dead_letters(tmp_path / "out")
    assert letter["source"] == "sqs" and "an array" in letter["reason"]
    assert base64.b64decode(letter["body_base64"]) == b"[1, 2, 3]"
    assert letter["position"]["queue"] == queue.url and letter["position"]["receive_count"] == 1
    from qworker.schema import dead_letter_key

    key = dead_letter_key("", "sqs", letter["message_id"])
    assert key == f"_dead_letters/sqs-{letter['message_id']}.json"
    assert (tmp_path / "out" / key).is_file()
    assert worker.summary.dead_lettered == worker.summary.dead_lettered_to_sink == 1
    assert _queue_counts(moto_server, queue.url) == (0, 0)


def test_an_sqs_dead_letter_queue_refusing_one_message_is_no_outage(
    tmp_path: Path, moto_server: str, sqs_queue: Callable[..., QueueInfo],
) -> None:
    sqs = boto_client("sqs", moto_server)
    queue = sqs_queue()
    dlq_url = sqs.create_queue(QueueName=f"{queue.name}-small-dlq",
                               Attributes={"MaximumMessageSize": "1024"})["QueueUrl"]
    source, uri = sqs_source(moto_server, queue.url, [POISON, chat_job("ok")], dlq_url=dlq_url)
    worker = asyncio.run(serve(settings(tmp_path, uri, source_outage_seconds=3), source,
                               tmp_path / "out"))
    assert worker.exit_code == 0  # not 69: the target answered, it refused this message
    assert set(read_results(tmp_path / "out")) == {"ok"}
    [letter] = _sink_dead_letters(tmp_path / "out")
    assert "refused it" in letter["reason"] and "shorter than 1024" in letter["reason"]
    assert base64.b64decode(letter["body_base64"]).decode() == POISON
    assert _queue_counts(moto_server, queue.url) == (0, 0)
    assert _queue_counts(moto_server, dlq_url) == (0, 0)


def test_a_kafka_dead_letter_topic_refusing_one_record_is_no_outage(tmp_path: Path) -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    schemas = tmp_path / "schema"
    schemas.mkdir()
    # The DLQ topic only takes JSON objects: tansu refuses anything else for good.
    (schemas / "jobs.dlq.json").write_text('{"type": "object", "properties": '
                                           '{"value": {"type": "object"}}}')
    broker = subprocess.Popen(
        [str(_tansu()), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/", "--schema-registry", "file://./schema",
         "--silent"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bootstrap = f"127.0.0.1:{port}"
    try:
        _wait_for_port(port, broker, timeout=20)
        from tests.fixtures.servers import create_topic

        create_topic(bootstrap, "jobs", 1)
        source, uri = kafka_source(bootstrap, "jobs", [chat_job("a"), POISON, chat_job("b")])
        worker = asyncio.run(serve(settings(tmp_path, uri, source_outage_seconds=3), source,
                                   tmp_path / "out"))
    finally:
        _stop(broker)
    assert worker.exit_code == 0
    assert set(read_results(tmp_path / "out")) == {"a", "b"}
    [letter] = _sink_dead_letters(tmp_path / "out")
    assert letter["source"] == "kafka" and "refused" in letter["reason"]
    assert letter["position"] == {"topic": "jobs", "partition": 0, "offset": 1}
    assert worker.summary.dead_lettered_to_sink == 1


class _RefusingSink(FileSink):
    """A directory that refuses every object of one key for good (as S3 does a bad key)."""

    refused: ClassVar[list[str]] = []

    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        from qworker.worker.sinks.file import SinkRefused

        if "refuse-me" in key:
            self.refused.append(key)
            raise SinkRefused(f"key {key} refused")
        return await super().put(key, body, fingerprint)


def test_a_record_the_sink_refuses_for_good_dead_letters_its_message(tmp_path: Path) -> None:
    source, uri = file_source(tmp_path, [chat_job("refuse-me"), chat_job("fine")])

    async def main() -> Worker:
        worker = Worker(settings(tmp_path, uri), EchoEngine(), source,
                        _RefusingSink(tmp_path / "out"))
        await asyncio.wait_for(worker.run(), 30)
        return worker

    worker = asyncio.run(main())
    assert worker.exit_code == 0
    assert set(read_results(tmp_path / "out")) == {"fine"}
    assert error_of(read_results(tmp_path / "out")["fine"]) is None
    # Its result, then its error record, refused: the message itself is dead-lettered.
    assert len(_RefusingSink.refused) == 2
    dlq = [json.loads(x) for x in (tmp_path / "jobs.jsonl.dlq").read_text().splitlines()]
    assert [d["message_id"] for d in dlq] == ["file:1"]
    assert "the sink refused this job's record" in dlq[0]["reason"]
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == {1, 2}
