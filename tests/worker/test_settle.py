"""The supervisor invariant (qworker/worker/settle.py): every received message is settled
exactly once, and an exception anywhere on one job's path settles that job only.

An exception is injected at each stage of the lifecycle (parse, validation, grammar
compile, tokenization, submit, record building, storing) for one marked job among good
ones; every other job must complete, the marked one must get its record (an
``invalid_request`` for an input problem, a 500 ``engine_error`` for ours), and
``--until-idle`` must exit 0. Regression: one exception in preparation (a
``RecursionError``) lost the whole receive batch, never acked nor handed back.
Parametrized over every stage on the file spool, and over the Kafka (tansu) and SQS
(moto) sources with every stage's victim in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.schema import error_of
from qworker.worker import preparing as preparing_module
from qworker.worker import settle as settle_module
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.job import Fate
from tests.worker.harness import file_source, kafka_source, serve, settings, sqs_source
from tests.worker.jobs import chat_job, read_results

#: stage -> the record code its victim must get.
STAGES = {
    "parse": "engine_error",       # prepare itself raised: ours
    "validate": "engine_error",    # a validator raised something else than a request error
    "grammar": "invalid_request",  # compiling its grammar recursed too deep: the request's
    "tokenize": "engine_error",    # the tokenizer crashed: ours
    "submit": "engine_error",      # the engine refused it with a bare exception
    "record": "engine_error",      # building its result line raised
    "store": "engine_error",       # serializing its result line raised
}
GOOD = 12


def _marker(stage: str) -> str:
    return f"boom-{stage}"


class _FaultyEcho(EchoEngine):
    """The echo engine, failing for prompts that carry a stage's marker."""

    def __init__(self, stages: set[str]) -> None:
        super().__init__(delay_ms=2)
        self.stages = stages

    def _has(self, stage: str, ids: list[int] | str) -> bool:
        text = ids if isinstance(ids, str) else bytes(ids).decode("utf-8", "replace")
        return stage in self.stages and _marker(stage) in text

    def encode_chat(self, messages: list[dict]) -> list[int]:
        ids = super().encode_chat(messages)
        if self._has("tokenize", ids):
            raise RuntimeError("tokenizer crashed")
        return ids

    def validate_prompt(self, prompt: Any, params: Any) -> tuple[str | None, list[int]]:
        if self._has("grammar", prompt):
            raise RecursionError("maximum recursion depth exceeded (compiling the grammar)")
        return super().validate_prompt(prompt, params)

    def add_validated(self, request_id: str, prompt: Any, prompt_token_ids: list[int],
                      params: Any, arrival_time: float | None = None) -> None:
        if self._has("submit", prompt_token_ids):
            raise RuntimeError("device refused the request")
        super().add_validated(request_id, prompt, prompt_token_ids, params, arrival_time)


@contextlib.contextmanager
def _inject(stages: set[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[_FaultyEcho]:
    real_prepare = preparing_module.prepare
    real_record_for = settle_module.record_for
    import qworker.schema.jobs as jobs_module
    real_sampling = jobs_module._sampling
    real_store = settle_module.ResultWriter.store_result

    def prepare(engine: Any, body: bytes, *args: Any, **kw: Any) -> Any:
        if "parse" in stages and _marker("parse").encode() in body:
            raise RuntimeError("the parser blew up")
        return real_prepare(engine, body, *args, **kw)

    def sampling(body: dict[str, Any], kind: Any) -> Any:
        if "validate" in stages and _marker("validate") in str(body.get("messages")):
            raise TypeError("a validator tripped over its own feet")
        return real_sampling(body, kind)

    def record_for(job: Any, *args: Any, **kw: Any) -> Any:
        if "record" in stages and job.custom_id == _marker("record"):
            raise KeyError("choices")
        return real_record_for(job, *args, **kw)

    async def store_result(self: Any, custom_id: str, batch_id: Any, record: dict[str, Any],
                           *args: Any, **kw: Any) -> Any:
        served = error_of(record) is None
        if "store" in stages and custom_id == _marker("store") and served:
            raise TypeError("Type is not JSON serializable: Tensor")
        return await real_store(self, custom_id, batch_id, record, *args, **kw)

    monkeypatch.setattr(preparing_module, "prepare", prepare)
    monkeypatch.setattr(jobs_module, "_sampling", sampling)
    monkeypatch.setattr(settle_module, "record_for", record_for)
    monkeypatch.setattr(settle_module.ResultWriter, "store_result", store_result)
    yield _FaultyEcho(stages)


def _lines(stages: set[str]) -> list[Any]:
    good = [chat_job(f"good-{i}", f"ordinary text {i}") for i in range(GOOD)]
    victims = [chat_job(_marker(stage), f"text with {_marker(stage)} in it")
               for stage in sorted(stages)]
    # Victims among the good jobs: they share receive batches and prep batches.
    return good[: GOOD // 2] + victims + good[GOOD // 2:]


def _check(worker: Any, out: Path, stages: set[str]) -> None:
    results = read_results(out)
    assert set(results) == {f"good-{i}" for i in range(GOOD)} | {_marker(s) for s in stages}
    for i in range(GOOD):
        assert error_of(results[f"good-{i}"]) is None
    for stage in stages:
        error = error_of(results[_marker(stage)])
        assert error is not None and error["code"] == STAGES[stage], (stage, error)
        assert error["status_code"] == (400 if STAGES[stage] == "invalid_request" else 500)
    summary = worker.summary
    assert worker.exit_code == 0 and summary.drain_reason == "idle"
    assert summary.settled == summary.received == GOOD + len(stages)
    assert summary.fates[Fate.ACKED.value] == GOOD + len(stages)
    assert summary.settled_twice == 0


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_an_exception_at_one_stage_settles_that_job_only_on_the_file_spool(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _inject({stage}, monkeypatch) as engine:
        source, uri = file_source(tmp_path, _lines({stage}))
        worker = asyncio.run(serve(settings(tmp_path, uri), source, tmp_path / "out", engine))
    _check(worker, tmp_path / "out", {stage})


def test_exceptions_at_every_stage_settle_their_jobs_only_on_kafka(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kafka_broker: str,
    kafka_topic: Callable[..., str],
) -> None:
    topic = kafka_topic(partitions=2)
    stages = set(STAGES)
    with _inject(stages, monkeypatch) as engine:
        source, uri = kafka_source(kafka_broker, topic, _lines(stages), group=f"{topic}-g")
        worker = asyncio.run(serve(settings(tmp_path, uri), source, tmp_path / "out", engine))
    _check(worker, tmp_path / "out", stages)


def test_exceptions_at_every_stage_settle_their_jobs_only_on_sqs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto_server: str,
    sqs_queue: Callable[..., Any],
) -> None:
    queue = sqs_queue()
    stages = set(STAGES)
    with _inject(stages, monkeypatch) as engine:
        source, uri = sqs_source(moto_server, queue.url, _lines(stages))
        worker = asyncio.run(serve(settings(tmp_path, uri), source, tmp_path / "out", engine))
    _check(worker, tmp_path / "out", stages)
