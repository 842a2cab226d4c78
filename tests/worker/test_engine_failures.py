"""Engine failures in the worker loop: retried steps, the job that fails alone, exit 70.

Regressions: one failing step wrote permanent ``engine_error`` records for every job in
flight (first write wins, so they could never be retried) and a flapping engine kept
exiting 0; a hung step or a dead engine thread left the worker "ready" while its
heartbeats hid its jobs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.config import WorkerSettings
from qworker.engine.outputs import RequestOutput
from qworker.schema import error_of
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.worker.jobs import acked_lines, chat_job, read_results, write_spool


def _run(tmp_path: Path, lines: list[Any], engine: EchoEngine,
         metrics: WorkerMetrics | None = None, **kw: Any) -> Worker:
    spool = write_spool(tmp_path / "jobs.jsonl", lines)
    settings = WorkerSettings(**{
        "source": f"file://{spool}", "sink": f"file://{tmp_path}/out", "model": "echo://",
        "until_idle": 0.3, "metrics_port": 0, "spot_metadata_url": "", **kw})

    async def main() -> Worker:
        worker = Worker(settings, engine, FileSource(spool), FileSink(tmp_path / "out"),
                        metrics=metrics)
        await asyncio.wait_for(worker.run(), 60)
        return worker

    return asyncio.run(main())


class _FailsOnce(EchoEngine):
    """The first step with work raises (a transient device error); later ones work."""

    def __init__(self) -> None:
        super().__init__(delay_ms=5, steps=3)
        self.failed = 0

    def step(self) -> list[RequestOutput]:
        with self._lock:
            busy = len(self._running) >= 4
        if not self.failed and busy:
            self.failed += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()


class _Poisoned(EchoEngine):
    """Every step fails while a request saying "boom" is in it (or every step: ``always``)."""

    def __init__(self, always: bool = False) -> None:
        super().__init__(delay_ms=2, steps=2, poison="boom", fail_rate=1.0 if always else 0.0)
        self.failures = 0

    def step(self) -> list[RequestOutput]:
        try:
            return super().step()
        except RuntimeError:
            self.failures += 1
            raise


def test_one_failed_step_retries_its_jobs_and_every_job_is_served(tmp_path: Path) -> None:
    engine = _FailsOnce()
    worker = _run(tmp_path, [chat_job(f"j{i}") for i in range(8)], engine)
    results = read_results(tmp_path / "out")
    assert engine.failed == 1
    assert set(results) == {f"j{i}" for i in range(8)}
    assert all(error_of(r) is None for r in results.values()), results
    assert worker.exit_code == 0 and worker.summary.step_failures == 1


def test_the_job_that_fails_alone_gets_engine_error_and_the_others_are_served(
    tmp_path: Path,
) -> None:
    engine = _Poisoned()
    lines = [chat_job(f"ok{i}") for i in range(7)]
    lines.insert(3, chat_job("poison", "boom"))
    worker = _run(tmp_path, lines, engine, max_job_attempts=3)
    results = read_results(tmp_path / "out")
    assert set(results) == {"poison"} | {f"ok{i}" for i in range(7)}
    error = error_of(results["poison"])
    assert error is not None and error["code"] == "engine_error"
    attempts = int(error["message"].split(" times when run alone")[0].rsplit(" ", 1)[1])
    assert attempts >= 3  # max_job_attempts, and only once other jobs proved the engine works
    assert all(error_of(results[f"ok{i}"]) is None for i in range(7))
    # Bisection down to the poison job, then its three solo attempts.
    assert engine.failures >= 3 + 1
    assert worker.exit_code == 0
    assert len(acked_lines(tmp_path / "jobs.jsonl.progress")) == 8


def test_a_poison_job_with_nothing_else_to_run_gets_its_engine_error_and_exit_0(
    tmp_path: Path,
) -> None:
    # Regression (the fault campaign): a lone poison job waited for another job to prove
    # the engine works, none came, and its solo retries ran the worker into exit 70.
    engine = _Poisoned()
    worker = _run(tmp_path, [chat_job("alone", "boom")], engine, max_job_attempts=3)
    error = error_of(read_results(tmp_path / "out")["alone"])
    assert error is not None and error["code"] == "engine_error"
    assert worker.exit_code == 0 and engine.failures == 3


def test_a_poison_job_waits_for_other_jobs_to_prove_the_engine_then_fails_alone(
    tmp_path: Path,
) -> None:
    # Regression (the fault campaign): with the other jobs still at the gate, a poison job
    # deferred only among the suspects was retried alone until the worker exited 70.
    engine = _Poisoned()
    lines = [chat_job("first", "boom")] + [chat_job(f"ok{i}") for i in range(4)]
    worker = _run(tmp_path, lines, engine, max_job_attempts=3, max_inflight_jobs=1)
    results = read_results(tmp_path / "out")
    assert error_of(results["first"])["code"] == "engine_error"
    assert all(error_of(results[f"ok{i}"]) is None for i in range(4))
    assert worker.exit_code == 0


def test_an_engine_whose_every_step_fails_exits_70_and_acks_nothing(tmp_path: Path) -> None:
    engine = _Poisoned(always=True)
    worker = _run(tmp_path, [chat_job(f"b{i}") for i in range(6)], engine)
    assert worker.exit_code == 70 and worker.summary.drain_reason == "fatal"
    assert read_results(tmp_path / "out") == {}  # nothing became a permanent error
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()
    assert worker.summary.abandoned == 6


class _Hangs(EchoEngine):
    """The first step with work never returns (until the test releases it)."""

    def __init__(self) -> None:
        super().__init__(delay_ms=1)
        self.release = threading.Event()

    def step(self) -> list[RequestOutput]:
        self.release.wait()
        return super().step()


def test_a_hung_step_fails_health_hands_every_job_back_and_exits_70(tmp_path: Path) -> None:
    engine = _Hangs()
    metrics = WorkerMetrics()
    seen: list[list[str]] = []

    def watch() -> None:
        while not engine.release.is_set():
            seen.append(metrics.problems)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        started = time.monotonic()
        worker = _run(tmp_path, [chat_job(f"h{i}") for i in range(4)], engine, metrics,
                      engine_step_timeout=1.0, until_idle=None)
        took = time.monotonic() - started
    finally:
        engine.release.set()
    assert worker.exit_code == 70 and took < 10
    assert ["engine"] in seen  # /healthz and /readyz failed while it stopped
    assert read_results(tmp_path / "out") == {}
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()
    assert worker.summary.abandoned == 4


class _Dies(EchoEngine):
    def step(self) -> list[RequestOutput]:
        raise SystemExit("the engine thread ends")  # not an Exception: the thread dies


def test_a_dead_engine_thread_exits_70(tmp_path: Path) -> None:
    worker = _run(tmp_path, [chat_job("d1")], _Dies(), until_idle=None)
    assert worker.exit_code == 70
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()
