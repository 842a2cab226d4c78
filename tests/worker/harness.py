"""Running one in-process worker against a file spool, a tansu topic or a moto queue.

``serve`` runs ``Worker.run`` to its end (bounded); the source builders give each
source the short timeouts the tests need. Every source is real: the file spool, the
tansu broker, moto's SQS (tests/fixtures/servers.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from qworker.config import WorkerSettings
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.base import Source
from qworker.worker.worker import Worker
from tests.worker.jobs import write_spool


def settings(tmp_path: Path, source: str, **kw: Any) -> WorkerSettings:
    """Worker settings for a test: echo model, file sink under ``tmp_path/out``."""
    base = {"source": source, "sink": f"file://{tmp_path}/out", "model": "echo://",
            "until_idle": 0.5, "metrics_port": 0, "spot_metadata_url": ""}
    return WorkerSettings(**{**base, **kw})


async def serve(cfg: WorkerSettings, source: Source, out: Path, engine: Any = None,
                timeout: float = 90) -> Worker:
    """Run one worker until it drains (at most ``timeout`` s); return it."""
    worker = Worker(cfg, engine or EchoEngine(), source, FileSink(out))
    await asyncio.wait_for(worker.run(), timeout)
    return worker


def body_of(line: dict[str, Any] | str | bytes) -> bytes:
    """A job line as message bytes (dicts JSON-encoded)."""
    if isinstance(line, dict):
        return json.dumps(line).encode()
    return line.encode() if isinstance(line, str) else line


def file_source(tmp_path: Path, lines: list[Any]) -> tuple[Source, str]:
    """A spool holding ``lines``; returns the source and its URI."""
    from qworker.worker.sources.file import FileSource

    spool = write_spool(tmp_path / "jobs.jsonl", lines)
    return FileSource(spool), f"file://{spool}"


def sqs_source(endpoint: str, url: str, lines: list[Any], **kw: Any) -> tuple[Source, str]:
    """Send ``lines`` to the queue at ``url``; a source reading it with short polls."""
    from qworker.worker.aws import ClientOptions, make_client
    from qworker.worker.sources.sqs import SqsSource
    from tests.fixtures.servers import boto_client

    sqs = boto_client("sqs", endpoint)
    for line in lines:
        sqs.send_message(QueueUrl=url, MessageBody=body_of(line).decode("utf-8", "replace"))
    client = make_client("sqs", ClientOptions(endpoint_url=endpoint, read_timeout=5,
                                              connect_timeout=1, max_attempts=1))
    return SqsSource(client, url, visibility_timeout=30, long_poll_seconds=1, **kw), f"sqs://{url}"


def kafka_source(bootstrap: str, topic: str, lines: list[Any], group: str = "t",
                 **kw: Any) -> tuple[Source, str]:
    """Produce ``lines`` to ``topic``; a group consumer with test timeouts."""
    from qworker.worker.sources.kafka import KafkaSource, produce

    items = [(None, body_of(line)) for line in lines]
    asyncio.run(produce(f"kafka://{bootstrap}/{topic}", items, None))
    source = KafkaSource(bootstrap, topic, group, session_timeout_ms=3000, commit_interval=0.2,
                         request_timeout=5, start_wait=2, **kw)
    return source, f"kafka://{bootstrap}/{topic}?group={group}"
