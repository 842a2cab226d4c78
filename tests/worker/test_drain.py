"""Signals and the drain budget (qworker/worker/drain.py).

Regressions: a second SIGTERM whose immediate stop got stuck ended the process with
exit 1 ("do not retry") although jobs were left; the worst-case drain (preparation
wait + drain + abort + store + close) had no bound at all (a source that did not close
held the process forever), far past the shipped ``terminationGracePeriodSeconds``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("orjson")
pytest.importorskip("pydantic_settings")

from qworker.worker import drain as drain_module
from qworker.worker.drain import DrainControl, DrainReason
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.sinks.base import PutResult
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.worker.harness import settings
from tests.worker.jobs import acked_lines, chat_job, write_spool


def _exits(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], threading.Event]:
    codes: list[int] = []
    called = threading.Event()

    def fake_exit(code: int) -> None:
        codes.append(code)
        called.set()

    monkeypatch.setattr(os, "_exit", fake_exit)
    return codes, called


def test_a_second_signal_whose_stop_gets_stuck_still_exits_75(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codes, called = _exits(monkeypatch)
    monkeypatch.setattr(drain_module, "IMMEDIATE_EXIT_AFTER_S", 0.2, raising=False)
    monkeypatch.setattr(drain_module, "HARD_EXIT_AFTER_S", 0.2, raising=False)  # before 18
    monkeypatch.setattr(drain_module, "EXIT_MARGIN_S", 60.0, raising=False)
    control = DrainControl()
    try:
        control.on_signal(signal.SIGTERM)
        control.on_signal(signal.SIGTERM)  # the stop then hangs: nothing else ends the process
        assert called.wait(10)
    finally:
        getattr(control, "disarm", lambda: None)()  # else its first timer ends this process
    assert codes == [75]  # work may be left: AWS Batch and Kubernetes retry
    assert control.immediate.is_set() and control.reason is DrainReason.SIGNAL


def test_a_drain_past_its_budget_ends_the_process_with_exit_75(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codes, called = _exits(monkeypatch)
    monkeypatch.setattr(drain_module, "EXIT_MARGIN_S", 0.0)
    from qworker.worker.drain import DrainBudget

    control = DrainControl(DrainBudget(prepare=0.1, run=0.1, abort=0.1, store=0.1, close=0.1))
    started = time.monotonic()
    try:
        control.on_signal(signal.SIGTERM)
        assert called.wait(10)
    finally:
        control.disarm()
    assert codes == [75] and 0.5 <= time.monotonic() - started < 5


def test_the_budget_sums_every_phase_and_the_grace_period_covers_it() -> None:
    from qworker.worker.drain import drain_budget

    budget = drain_budget(90)
    assert budget.run == 90
    assert budget.total == budget.prepare + budget.run + budget.abort + budget.store + budget.close
    assert budget.grace_seconds >= budget.total + drain_module.EXIT_MARGIN_S
    assert budget.grace_seconds <= 120  # fits the two minutes of an EC2 spot notice


class _DownSink(FileSink):
    async def put(self, key: str, body: bytes, fingerprint: str | None = None) -> PutResult:
        raise OSError("503 SlowDown")


class _StuckClose(FileSource):
    """A source whose close never returns (a broker that does not answer LeaveGroup)."""

    close_started = False

    async def close(self) -> None:
        self.close_started = True
        await asyncio.Event().wait()


def test_every_drain_phase_fits_the_drain_budget(tmp_path: Path) -> None:
    lines: list[Any] = [chat_job(f"long-{i}") for i in range(3)]  # run until aborted
    lines += [chat_job(f"bad-{i}", temperature=-1) for i in range(3)]  # records never stored
    spool = write_spool(tmp_path / "jobs.jsonl", lines)
    source = _StuckClose(spool)
    cfg = settings(tmp_path, f"file://{spool}", until_idle=None, drain_seconds=1)
    from qworker.worker.drain import DrainBudget

    # Every phase of the real budget, shorter (the real one's constants: the test above).
    budget = DrainBudget(prepare=0.5, run=cfg.drain_seconds, abort=0.5, store=1.0, close=1.0)
    drain = DrainControl(budget)

    async def main() -> tuple[Worker, float]:
        worker = Worker(cfg, EchoEngine(delay_ms=5, steps=100_000), source,
                        _DownSink(tmp_path / "out"), drain=drain)
        worker.budget = budget
        loop = asyncio.get_running_loop()
        requested: list[float] = []

        def request() -> None:
            requested.append(time.monotonic())
            drain.request(DrainReason.SIGNAL)

        loop.call_later(1.5, request)
        await asyncio.wait_for(worker.run(), 60)
        return worker, time.monotonic() - requested[0]

    worker, took = asyncio.run(main())
    assert took <= budget.total + 1.0, f"the drain took {took:.1f}s, budget {budget.total}s"
    assert source.close_started
    assert worker.exit_code == 75  # work was left
    assert worker.summary.abandoned == len(lines) and worker.summary.settled == len(lines)
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()


def test_a_sigterm_before_the_worker_could_handle_it_drains_with_exit_75(
    tmp_path: Path,
) -> None:
    # Regression: a SIGTERM in the first second (while ``qworker run`` was importing)
    # killed the process by the signal (rc 143 / -15) instead of a drain's 75. The CLI
    # now captures it and hands it to ``serve``, which drains before serving anything.
    from qworker.worker.app import serve

    spool = write_spool(tmp_path / "jobs.jsonl", [chat_job("never-served")])
    cfg = settings(tmp_path, f"file://{spool}", until_idle=None)
    code, summary = asyncio.run(serve(cfg, pending_signals=[signal.SIGTERM]))
    assert code == 75 and summary.received == 0
    assert acked_lines(tmp_path / "jobs.jsonl.progress") == set()
