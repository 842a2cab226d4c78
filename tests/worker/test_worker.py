"""The worker loop in-process with the echo engine over file:// (qworker/worker/worker.py)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.config import WorkerSettings
from qworker.engine.outputs import RequestOutput
from qworker.schema import error_of
from qworker.worker.drain import DrainControl, DrainReason
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.sinks.base import PutResult
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.worker.jobs import (
    acked_lines,
    chat_job,
    completion_job,
    read_results,
    write_spool,
)


def _settings(tmp_path: Path, **kw: Any) -> WorkerSettings:
    base = {
        "source": f"file://{tmp_path}/jobs.jsonl",
        "sink": f"file://{tmp_path}/out",
        "model": "echo://",
        "until_idle": 0.3,
        "metrics_port": 0,
        "spot_metadata_url": "",
    }
    return WorkerSettings(**{**base, **kw})


def _run(
    tmp_path: Path,
    lines: list[Any],
    engine: Any = None,
    drain: DrainControl | None = None,
    **kw: Any,
) -> Worker:
    spool = write_spool(tmp_path / "jobs.jsonl", lines)
    settings = _settings(tmp_path, **kw)

    async def main() -> Worker:
        worker = Worker(
            settings,
            engine or EchoEngine(),
            FileSource(spool),
            FileSink(tmp_path / "out"),
            drain=drain,
        )
        await asyncio.wait_for(worker.run(), 30)
        return worker

    return asyncio.run(main())


def test_every_job_gets_exactly_one_record_and_is_acked(tmp_path: Path) -> None:
    lines = [chat_job(f"c{i}", f"text {i}") for i in range(20)]
    lines += [completion_job("p1", "abc"), completion_job("p2", [104, 105])]
    worker = _run(tmp_path, lines)
    results = read_results(tmp_path / "out")
    assert set(results) == {f"c{i}" for i in range(20)} | {"p1", "p2"}
    assert results["p1"]["response"]["body"]["choices"][0]["text"] == "abc"
    assert results["p2"]["response"]["body"]["choices"][0]["text"] == "hi"
    chat = results["c3"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == "echo"
    assert chat["choices"][0]["message"]["content"] == "user: te"  # max_tokens=8 bytes
    assert chat["choices"][0]["finish_reason"] == "length"
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set(range(1, 23))
    assert worker.summary.completed["success"] == 22 and worker.exit_code == 0


def test_invalid_jobs_get_error_records_and_the_worker_keeps_going(tmp_path: Path) -> None:
    lines: list[Any] = [
        chat_job("ok1"),
        "this is not json",
        b"\xff\xfe not utf-8",
        "[1, 2, 3]",
        {"custom_id": "bad-url", "url": "/v1/images/generations", "body": {}},
        chat_job("bad-temp", temperature=-1),
        chat_job("bad-tools", tools=[{"type": "function"}]),
        completion_job("too-long", "x" * 100),
        chat_job("expired") | {"deadline": time.time() - 10},
        chat_job("ok2"),
    ]
    worker = _run(tmp_path, lines, engine=EchoEngine(max_model_len=64))
    results = read_results(tmp_path / "out")
    codes = {cid: (error_of(r) or {}).get("code") for cid, r in results.items()}
    assert codes == {
        "ok1": None,
        "ok2": None,
        "bad-url": "invalid_request",
        "bad-temp": "invalid_request",
        "bad-tools": "invalid_request",
        "too-long": "context_length_exceeded",
        "expired": "batch_expired",
    }
    assert error_of(results["too-long"])["message"] == "prompt is 100 tokens; max_model_len is 64"
    dlq = [json.loads(x) for x in (tmp_path / "jobs.jsonl.dlq").read_text().splitlines()]
    assert [d["message_id"] for d in dlq] == ["file:2", "file:3", "file:4"]
    assert dlq[2]["reason"] == "job must be a JSON object, got an array"
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set(range(1, 11))
    assert worker.summary.dead_lettered == 3


def test_deadline_passing_inside_the_engine_gives_batch_expired(tmp_path: Path) -> None:
    slow = EchoEngine(delay_ms=50, steps=200)  # ~10 s per request
    lines = [chat_job("late") | {"deadline": time.time() + 0.5}]
    _run(tmp_path, lines, engine=slow)
    record = read_results(tmp_path / "out")["late"]
    assert error_of(record)["code"] == "batch_expired"


def test_existing_result_counts_as_duplicate_and_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "out" / "default").mkdir(parents=True)
    (tmp_path / "out" / "default" / "d1.json").write_text('{"custom_id": "d1", "first": true}')
    worker = _run(tmp_path, [chat_job("d1"), chat_job("d2")])
    assert json.loads((tmp_path / "out" / "default" / "d1.json").read_text())["first"] is True
    assert worker.summary.duplicates == 1
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == {1, 2}


async def _until(done: Any, timeout: float = 30.0) -> None:
    """Wait for ``done()`` (polled on the loop): an event, not a guess at how long it takes."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the awaited state never came"
        await asyncio.sleep(0.01)


def test_drain_abandons_unfinished_jobs_without_acking(tmp_path: Path) -> None:
    drain = DrainControl()
    slow = EchoEngine(delay_ms=20, steps=10_000)
    lines = [chat_job(f"s{i}") for i in range(3)]

    async def main() -> Worker:
        spool = write_spool(tmp_path / "jobs.jsonl", lines)
        settings = _settings(tmp_path, until_idle=None, drain_seconds=0.3)
        worker = Worker(settings, slow, FileSource(spool), FileSink(tmp_path / "out"), drain=drain)

        async def trigger() -> None:  # once all three are inside the engine
            await _until(lambda: len(worker.table.running) == 3)
            drain.request(DrainReason.SIGNAL)

        await asyncio.gather(worker.run(), trigger())
        return worker

    worker = asyncio.run(main())
    assert read_results(tmp_path / "out") == {}
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()
    assert worker.summary.abandoned == 3 and worker.summary.drain_reason == "signal"
    assert worker.exit_code == 75  # drained with work left: AWS Batch retries the child


def test_admission_keeps_waiting_work_within_the_pool(tmp_path: Path) -> None:
    # 8 blocks of 16 tokens, 2 in reserve: prompts of ~3 blocks -> at most 2 admitted at once.
    engine = EchoEngine(delay_ms=5, steps=3, num_kv_blocks=8)
    peak = 0
    real_step = engine.step

    def step() -> list[RequestOutput]:
        nonlocal peak
        stats = engine.stats()
        peak = max(peak, stats["num_requests_running"] + stats["num_requests_waiting"])
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    _run(
        tmp_path,
        [completion_job(f"a{i}", "y" * 40) for i in range(10)],
        engine=engine,
        admission_buffer_blocks=2,
    )
    assert len(read_results(tmp_path / "out")) == 10
    assert 1 <= peak <= 2


def test_metrics_endpoint_exposes_the_design_names(tmp_path: Path) -> None:
    metrics = WorkerMetrics()
    port = metrics.serve(0, host="127.0.0.1")
    try:
        spool = write_spool(tmp_path / "jobs.jsonl", [chat_job("m1"), "junk"])
        settings = _settings(tmp_path)

        async def main() -> None:
            worker = Worker(
                settings,
                EchoEngine(),
                FileSource(spool),
                FileSink(tmp_path / "out"),
                metrics=metrics,
            )
            await worker.run()

        assert _get(port, "/readyz")[0] == 503  # not loaded yet
        asyncio.run(main())
        code, text = _get(port, "/metrics")
        assert code == 200 and _get(port, "/healthz")[0] == 200
        for name in [
            "qworker_num_requests_running",
            "qworker_num_requests_waiting",
            "qworker_kv_cache_usage_perc",
            "qworker_num_preemptions_total",
            "qworker_prompt_tokens_total",
            "qworker_generation_tokens_total",
            "qworker_prefix_cache_hits_total",
            "qworker_time_to_first_token_seconds",
            "qworker_e2e_request_latency_seconds",
            "qworker_jobs_received_total",
            "qworker_jobs_completed_total",
            "qworker_jobs_duplicate_total",
            "qworker_jobs_dead_lettered_total",
            "qworker_inflight_jobs",
            "qworker_uncommitted_offsets",
            "qworker_sink_put_seconds",
            "qworker_sink_retries_total",
            "qworker_draining",
            "qworker_spot_interruptions_total",
        ]:
            assert f"\n{name}" in text, name
        assert 'qworker_jobs_completed_total{status="success"} 1.0' in text
        assert "qworker_jobs_dead_lettered_total 1.0" in text
        assert "qworker_jobs_received_total 2.0" in text
        assert 'qworker_e2e_request_latency_seconds_count{model_name="echo"} 1.0' in text
        assert "qworker_draining 1.0" in text
    finally:
        metrics.close()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class _BrokenSink(FileSink):
    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        raise OSError("disk on fire")


def test_a_sink_that_keeps_failing_stops_the_worker_with_exit_69_and_nothing_acked(
    tmp_path: Path,
) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job(f"f{i}") for i in range(8)])

    async def main() -> Worker:
        worker = Worker(
            _settings(tmp_path, until_idle=None, sink_outage_seconds=1.5),
            EchoEngine(),
            FileSource(spool),
            _BrokenSink(tmp_path / "out"),
        )
        await asyncio.wait_for(worker.run(), 30)
        return worker

    worker = asyncio.run(main())
    assert worker.exit_code == 69 and worker.summary.drain_reason == "fatal"
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()


class _OutageSink(FileSink):
    """Fails every write until ``fail_until`` (monotonic), then works."""

    fail_until = 0.0
    failures = 0

    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        if time.monotonic() < self.fail_until:
            self.failures += 1
            raise OSError("503 SlowDown")
        return await super().put(key, body, fingerprint)


class _OneAtATime(FileSource):
    """Hands out one message per receive and notes whether the sink was down then."""

    worker: Worker | None = None
    received_while_down = 0

    async def receive(self, max_messages: int, timeout: float) -> list:
        msgs = await super().receive(1, timeout)
        if msgs and self.worker is not None and self.worker.sink_down:
            self.received_while_down += 1
        return msgs


def test_a_sink_outage_is_ridden_out_without_receiving_and_every_job_is_written(
    tmp_path: Path,
) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job(f"o{i}") for i in range(6)])
    sink = _OutageSink(tmp_path / "out")
    source = _OneAtATime(spool)

    async def main() -> Worker:
        worker = Worker(_settings(tmp_path, until_idle=0.5, sink_outage_seconds=60), EchoEngine(),
                        source, sink)
        source.worker = worker
        sink.fail_until = time.monotonic() + 2.5
        await asyncio.wait_for(worker.run(), 30)
        return worker

    worker = asyncio.run(main())
    assert worker.exit_code == 0 and worker.summary.drain_reason == "idle"
    assert sink.failures >= 2  # the outage really held results back, more than once
    assert source.received_while_down == 0
    assert set(read_results(tmp_path / "out")) == {f"o{i}" for i in range(6)}
    assert len(acked_lines(tmp_path / "jobs.jsonl.progress")) == 6


def test_a_drain_during_a_sink_outage_stops_retrying_at_the_drain_budget(tmp_path: Path) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job(f"d{i}") for i in range(4)])
    sink = _OutageSink(tmp_path / "out")
    sink.fail_until = float("inf")
    drain = DrainControl()

    async def main() -> tuple[Worker, float]:
        worker = Worker(_settings(tmp_path, until_idle=None, drain_seconds=1), EchoEngine(),
                        FileSource(spool), sink, drain=drain)
        requested: list[float] = []

        async def trigger() -> None:  # once the sink has refused the finished results
            await _until(lambda: sink.failures >= 4)
            requested.append(time.monotonic())
            drain.request(DrainReason.SIGNAL)

        await asyncio.wait_for(asyncio.gather(worker.run(), trigger()), 30)
        return worker, time.monotonic() - requested[0]

    worker, took = asyncio.run(main())
    assert worker.exit_code == 75 and worker.summary.drain_reason == "signal"  # work left
    # Writes are retried until the run phase ends (prepare + drain_seconds), then given up:
    # not the whole outage budget (300 s).
    budget = worker.budget
    assert took < budget.prepare + budget.run + budget.abort + budget.store + 2
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()


class _HangingStart(FileSource):
    closed = False

    async def start(self) -> None:
        await asyncio.Event().wait()  # a broker that never answers

    async def close(self) -> None:
        self.closed = True
        await super().close()


def test_a_drain_during_source_start_cancels_the_start_and_exits_75(tmp_path: Path) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job("s1")])
    source = _HangingStart(spool)
    drain = DrainControl()

    async def main() -> tuple[Worker, float]:
        worker = Worker(_settings(tmp_path, until_idle=None), EchoEngine(), source,
                        FileSink(tmp_path / "out"), drain=drain)
        asyncio.get_running_loop().call_later(0.3, drain.request, DrainReason.SIGNAL)
        started = time.monotonic()
        await asyncio.wait_for(worker.run(), 30)
        return worker, time.monotonic() - started

    worker, took = asyncio.run(main())
    assert worker.exit_code == 75 and worker.summary.drain_reason == "signal"
    assert took < 5 and source.closed
    assert worker.summary.received == 0 and read_results(tmp_path / "out") == {}


class _FlakySource(FileSource):
    fails = 3

    async def receive(self, max_messages: int, timeout: float) -> list:
        if self.fails:
            self.fails -= 1
            raise ConnectionError("broker unreachable")
        return await super().receive(max_messages, timeout)


def test_transient_receive_failures_are_ridden_out(tmp_path: Path) -> None:
    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job("r1")])

    async def main() -> Worker:
        worker = Worker(
            _settings(tmp_path), EchoEngine(), _FlakySource(spool), FileSink(tmp_path / "out")
        )
        await asyncio.wait_for(worker.run(), 30)
        return worker

    worker = asyncio.run(main())
    assert worker.exit_code == 0 and set(read_results(tmp_path / "out")) == {"r1"}


# ---------------------------------------------------------------- hostile input (issue 18)

def _deep(depth: int, leaf: str = "1") -> str:
    return '{"a":' * depth + leaf + "}" * depth


def _hostile_lines() -> dict[str, bytes]:
    """custom_id -> a job whose JSON nests deep in one field (each once made preparation
    raise RecursionError, losing its whole receive batch)."""
    msgs = '"messages":[{"role":"user","content":"hi"}]'

    def job(cid: str, body: str) -> bytes:
        return (f'{{"custom_id":"{cid}","url":"/v1/chat/completions","body":{{{body}}}}}'
                ).encode()

    return {
        "deep-guided-json-text": job("deep-guided-json-text",
                                     f'{msgs},"guided_json":{json.dumps(_deep(3000))}'),
        "deep-schema": job("deep-schema", f'{msgs},"response_format":{{"type":"json_schema",'
                           f'"json_schema":{{"name":"x","schema":{_deep(300)}}}}}'),
        "deep-content": job("deep-content", '"messages":[{"role":"user","content":'
                            + "[" * 1000 + "]" * 1000 + "}]"),
        "deep-choice": job("deep-choice", f'{msgs},"guided_choice":' + "[" * 1000 + '"a"'
                           + "]" * 1000),
        "deep-logit-bias": job("deep-logit-bias", f'{msgs},"logit_bias":{{"1":'
                               + "[" * 1000 + "]" * 1000 + "}"),
    }


def test_deeply_nested_jobs_get_invalid_request_and_every_good_job_in_their_batch_is_answered(
    tmp_path: Path,
) -> None:
    hostile = _hostile_lines()
    good = [chat_job(f"good-{i}", f"text {i}") for i in range(24)]
    lines: list[Any] = good[:12] + list(hostile.values()) + good[12:]
    worker = _run(tmp_path, lines)
    results = read_results(tmp_path / "out")
    assert {f"good-{i}" for i in range(24)} <= set(results), "good jobs were lost"
    assert all(error_of(results[f"good-{i}"]) is None for i in range(24))
    params = {}
    for cid in hostile:
        error = error_of(results[cid])
        assert error is not None and error["code"] == "invalid_request", (cid, error)
        assert "nested deeper than" in error["message"]
        params[cid] = error["param"]
    assert params == {"deep-guided-json-text": "guided_json", "deep-schema": "response_format",
                      "deep-content": "messages[0].content", "deep-choice": "guided_choice[0]",
                      "deep-logit-bias": "logit_bias"}
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set(range(1, len(lines) + 1))
    assert worker.exit_code == 0


def test_a_line_far_over_max_job_bytes_is_answered_without_being_read_whole(
    tmp_path: Path,
) -> None:
    import tracemalloc

    huge = ('{"custom_id": "huge", "url": "/v1/completions", "body": {"prompt": "'
            + "x" * (24 << 20) + '"}, "batch_id": "b1"}')
    anonymous = '{"url": "/v1/completions", "body": {"prompt": "' + "y" * (2 << 20) + '"}}'
    lines: list[Any] = [chat_job("before"), huge, anonymous, chat_job("after")]
    write_spool(tmp_path / "jobs.jsonl", lines)
    del huge, anonymous, lines
    tracemalloc.start()
    try:
        async def main() -> Worker:
            cfg = _settings(tmp_path, max_job_bytes=64 << 10)
            worker = Worker(cfg, EchoEngine(), FileSource.from_uri(cfg.source, cfg),
                            FileSink(tmp_path / "out"))
            await asyncio.wait_for(worker.run(), 30)
            return worker

        worker = asyncio.run(main())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB: the 24 MiB line was read whole"
    results = read_results(tmp_path / "out")
    assert set(results) == {"before", "huge", "after"}
    error = error_of(results["huge"])
    assert error["code"] == "invalid_request" and "max_job_bytes" in error["message"]
    assert results["huge"]["batch_id"] == "b1"
    dlq = [json.loads(x) for x in (tmp_path / "jobs.jsonl.dlq").read_text().splitlines()]
    assert [d["message_id"] for d in dlq] == ["file:3"] and dlq[0]["truncated"] is True
    assert "custom_id could not be read" in dlq[0]["reason"]
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == {1, 2, 3, 4}
    assert worker.exit_code == 0


def test_a_spool_replaced_at_the_same_path_is_served_from_its_first_line(tmp_path: Path) -> None:
    _run(tmp_path, [chat_job(f"old-{i}") for i in range(5)])
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set(range(1, 6))
    # Another batch written to the same path: none of its lines was ever served.
    (tmp_path / "jobs.jsonl").unlink()
    worker = _run(tmp_path, [chat_job(f"new-{i}") for i in range(7)])
    assert {f"new-{i}" for i in range(7)} <= set(read_results(tmp_path / "out"))
    assert worker.summary.received == 7
    # Appending to a spool keeps its progress: only the new line is served.
    with (tmp_path / "jobs.jsonl").open("a") as out:
        out.write(json.dumps(chat_job("appended")) + "\n")

    async def again() -> Worker:
        worker = Worker(_settings(tmp_path), EchoEngine(), FileSource(tmp_path / "jobs.jsonl"),
                        FileSink(tmp_path / "out"))
        await asyncio.wait_for(worker.run(), 30)
        return worker

    assert asyncio.run(again()).summary.received == 1
    assert "appended" in read_results(tmp_path / "out")
