"""The worker: an event router between a source, the engine thread and a sink.

Each received message becomes one ``Job`` record (qworker/worker/job.py, where its
states and transitions are) and ends through ``settle`` (qworker/worker/settle.py,
the only caller of the source's ack / abandon / dead-letter). This module routes the
events that move jobs: messages received (prepared on a thread pool), the gate
admitting ready jobs (``Gate``), engine outputs and failed steps (``StepFailures``),
revocations, deadlines, cancelled batches (``CancelWatch``), the spot notice and the
drain (``drain_budget``).

Failures (docs/operations.md): a failing source, sink or dead-letter target is retried
by its ``Retrier`` for its outage budget, then the worker stops with exit 69; a failed
engine step sends its jobs back through the gate in bisected groups until the job that
fails on its own is found (``engine_error`` after ``max_job_attempts`` solo failures);
steps that keep failing, a step past ``engine_step_timeout`` or a dead engine thread
stop the worker with exit 70, every unsettled job handed back. Any exception on one
job's path settles that job only (the supervisor in ``settle``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from qworker.config import WorkerSettings
from qworker.engine.outputs import RequestOutput
from qworker.errors import BatchExpiredError, EngineError
from qworker.worker.admission import Admission
from qworker.worker.cancel_watch import CancelWatch, watch_held
from qworker.worker.dead_letters import DeadLetters
from qworker.worker.drain import DrainControl, DrainReason, drain_budget
from qworker.worker.drain_phases import drain_phases
from qworker.worker.engine_thread import EngineLike, EngineThread, watchdog
from qworker.worker.exit_codes import ExitCode
from qworker.worker.gate import Gate
from qworker.worker.idle import IdleCheck
from qworker.worker.job import AT_GATE, AbortReason, Fate, Job, JobState
from qworker.worker.job_table import JobTable
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.preparing import Preparer
from qworker.worker.requests import token_decoder
from qworker.worker.result_writer import ResultWriter
from qworker.worker.retry import GaveUp, Retrier
from qworker.worker.served_models import ServedModels
from qworker.worker.settle import Settler
from qworker.worker.sinks.base import Sink
from qworker.worker.source_start import Started, start_source
from qworker.worker.sources.base import Message, Source
from qworker.worker.spot import SpotPoller
from qworker.worker.step_failures import StepFailures
from qworker.worker.summary import RunSummary
from qworker.worker.tasks import Tasks
from qworker.worker.token_admission import embedding_admission

log = logging.getLogger(__name__)

S = JobState
_RECEIVE_TIMEOUT_S = 0.25
_STATS_INTERVAL_S = 0.25
_PROGRESS_INTERVAL_S = 10.0
_MAX_RECEIVE = 64
_JUDGE_AFTER_S = 1.0  # quiet this long with only deferred jobs: judge them
_SIGNALLED = (DrainReason.SIGNAL, DrainReason.SPOT)


class Worker:
    """One worker: drives ``engine`` with jobs from ``source``, results into ``sink``.

    ``run()`` returns when the drain finished (signal, spot notice, ``until_idle``,
    or a fatal failure); ``exit_code`` is then an ``ExitCode`` (docs/operations.md).
    Create and run it inside the event loop that will own it.
    """

    def __init__(self, settings: WorkerSettings, engine: EngineLike, source: Source,
                 sink: Sink, sink_prefix: str = "", metrics: WorkerMetrics | None = None,
                 drain: DrainControl | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.source = source
        self.sink = sink
        self.metrics = metrics or WorkerMetrics()
        self.metrics.set_model(engine.model_name)
        self.budget = drain_budget(settings.drain_seconds)
        self.drain = drain or DrainControl(self.budget)
        self.admission = Admission(settings.max_inflight_jobs, settings.admission_buffer_blocks)
        self.summary = RunSummary()
        self.exit_code = ExitCode.OK
        self.table = JobTable()
        self.tasks = Tasks()
        self._store_until: float | None = None  # monotonic end of a drain's store phase
        problem = self.metrics.set_problem

        def fail_69(why: str) -> None:
            self._fail(ExitCode.UNAVAILABLE, why)

        # Refused credentials are a configuration error until the source started, and a
        # fatal stop (exit 69) after: they worked, so they rotated or expired (retry.py).
        self._serving = False

        def serving() -> bool:
            return self._serving

        self.source_retrier = Retrier(
            Outage("source", settings.source_outage_seconds, problem),
            Backoff(first=0.2, cap=5.0), wake=self.drain.draining,
            on_exhausted=fail_69, on_fatal=fail_69, running=serving)
        self.writer = ResultWriter(sink, Retrier(
            Outage("sink", settings.sink_outage_seconds, problem), Backoff(),
            wake=self.drain.immediate, deadline=lambda: self._store_until,
            on_exhausted=fail_69, on_fatal=fail_69, running=serving), self.metrics,
            sink_prefix)
        self.dead_letters = DeadLetters(source, Retrier(
            Outage("dead_letter", settings.source_outage_seconds, problem),
            Backoff(first=0.2, cap=5.0), wake=self.drain.immediate,
            deadline=lambda: self._store_until, on_exhausted=fail_69, on_fatal=fail_69,
            running=serving), self.writer)
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="qworker-prep")
        self._progress = asyncio.Event()
        self.settler = Settler(self.table, source, self.writer, self.dead_letters,
                               self.metrics, self.summary, self.tasks, self._pool,
                               engine.model_name, token_decoder(engine), self._progress.set)
        self.cancels = CancelWatch(sink, sink_prefix, settings.cancel_check_seconds)
        self.preparer = Preparer(engine, settings.max_job_bytes, self._pool, self.table,
                                 self.settler, self._admit,
                                 ServedModels.from_settings(settings, engine.model_name),
                                 self.cancels)
        self.failures = StepFailures(self.table, settings.max_job_attempts)
        self.idle = IdleCheck(source, self.source_retrier)
        self._kv_usage = 0.0
        self._last_activity = time.monotonic()
        self._block_size = engine.stats().block_size
        self._thread: EngineThread | None = None
        self.gate: Gate | None = None
        self._engine_hung = False

    @property
    def sink_down(self) -> bool:
        """True while the sink keeps failing: receiving pauses until a write succeeds."""
        return self.writer.sink_down

    @property
    def busy(self) -> int:
        """Jobs received here and not yet settled."""
        return self.table.busy

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> RunSummary:
        """Serve until drained; see the class docstring."""
        loop = asyncio.get_running_loop()
        self._thread = EngineThread(self.engine, loop, self._on_outputs, self._on_step_error,
                                    self._block_size)
        self.gate = Gate(self.table, self.admission, self.engine, self._thread,
                         self._block_size, self.settler.answer_error, embedding_admission(
                             self.engine, self.settings.max_inflight_jobs))
        self.source.on_revoke = self._on_revoke
        try:
            started = await start_source(self.source, self.drain, self.source_retrier,
                                         self.budget.close)
        except BaseException:
            self._pool.shutdown(wait=False)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.sink.close(), self.budget.close)
            raise
        if started is not Started.STARTED:
            if started is Started.UNREACHABLE:
                self._fail(ExitCode.UNAVAILABLE, "source unreachable at start")
            else:
                self.exit_code = ExitCode.DRAINED  # nothing served, but the source may hold work
            await self._bounded(self.sink.close(), time.monotonic() + self.budget.close, "sink")
            self._pool.shutdown(wait=False)
            self._finish_summary()
            return self.summary
        self._last_activity = time.monotonic()  # joining a group is not idle time
        self._serving = True
        self._thread.start()
        helpers = [asyncio.create_task(self._stats_loop()),
                   asyncio.create_task(self._deadline_loop()),
                   asyncio.create_task(watch_held(self.cancels, self.table,
                                                  self.settler.answer_error,
                                                  self.drain.draining.is_set)),
                   asyncio.create_task(watchdog(self._thread, self.settings.engine_step_timeout,
                                                self._on_engine_failure))]
        if self.settings.spot_metadata_url:
            poller = SpotPoller(self.settings.spot_metadata_url, self.settings.spot_poll_seconds,
                                self._on_spot_notice)
            helpers.append(asyncio.create_task(poller.run()))
        self.metrics.ready = True
        close_until = None
        try:
            await self._admit_loop()
            close_until = await self._drain()
            if self.exit_code == ExitCode.OK and self.drain.reason in _SIGNALLED:
                self.exit_code = await self._drain_exit_code(close_until)
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            until = close_until or time.monotonic() + self.budget.close
            self._thread.stop(0.5 if self._engine_hung else max(0.1, until - time.monotonic()))
            self._sample_stats(0.0)
            await self._bounded(self.sink.close(), until, "sink")
            await self._bounded(self.source.close(), until, "source")
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.metrics.ready = False
            self._finish_summary()
        return self.summary

    def _finish_summary(self) -> None:
        # An idle exit waited until_idle seconds for nothing: leave that out of the rates.
        idle = self.drain.reason is DrainReason.IDLE
        self.summary.finished = self._last_activity if idle else time.monotonic()
        self.summary.drain_reason = self.drain.reason.value if self.drain.reason else None
        if self.summary.settled != self.summary.received:
            log.error("%d messages received but %d settled: a message was not settled "
                      "exactly once", self.summary.received, self.summary.settled)

    def _fail(self, code: ExitCode, why: str, immediate: bool = False) -> None:
        """Stop with ``code``: a graceful drain (finished work is still stored) or at once."""
        log.error("%s: stopping (exit %d)", why, code)
        if self.exit_code == ExitCode.OK:
            self.exit_code = code
        if immediate:
            self.drain.request_immediate(DrainReason.FATAL)
        else:
            self.drain.request(DrainReason.FATAL)

    async def _drain_exit_code(self, until: float) -> ExitCode:
        """After a signal or spot drain: 0 only if no work was left, here or at the source."""
        if self.summary.abandoned:
            return ExitCode.DRAINED
        try:
            pending = await asyncio.wait_for(self.source.pending_work(),
                                             max(0.1, (until - time.monotonic()) / 2))
        except Exception as exc:
            log.warning("cannot tell whether the source has pending work: %r", exc)
            return ExitCode.DRAINED
        return ExitCode.OK if pending == 0 else ExitCode.DRAINED

    @staticmethod
    async def _bounded(call: Awaitable[Any], until: float, what: str) -> None:
        try:
            await asyncio.wait_for(call, max(0.1, until - time.monotonic()))
        except TimeoutError:
            log.warning("closing the %s overran the drain budget: left unfinished", what)
        except Exception as exc:
            log.warning("closing the %s failed: %r", what, exc)

    # ------------------------------------------------------------ receiving

    async def _admit_loop(self) -> None:
        until_idle = self.settings.until_idle
        while not self.drain.draining.is_set():
            self._admit()
            room = self.gate.room() if self.gate is not None else 0
            if room == 0 or self.writer.sink_down:
                # A failing sink: finished work waits for it, so take no new work.
                await self._wait_progress(0.05 if room == 0 else 0.25)
                continue
            msgs = await self._receive(min(room, _MAX_RECEIVE))
            if msgs and self.drain.draining.is_set():
                for job in self.settler.received(msgs):
                    self.settler.settle_later(job, Fate.HANDED_BACK)
                break
            if msgs:
                self._last_activity = time.monotonic()
                self.preparer.start(msgs)
            elif (self.table.deferred and self.busy == len(self.table.deferred)
                  and time.monotonic() - self._last_activity >= _JUDGE_AFTER_S):
                for job in self.failures.judge_deferred():
                    self._engine_error(job, "no other job was left to run beside it")
            elif (until_idle is not None and self.busy == 0
                  and time.monotonic() - self._last_activity >= until_idle
                  and await self.idle.source_drained()):
                log.info("idle for %.1fs, nothing in flight and no pending work at the source: "
                         "stopping", until_idle)
                self.drain.request(DrainReason.IDLE)

    async def _receive(self, max_messages: int) -> list[Message]:
        """``source.receive`` through the source retrier (an outage is ridden out there)."""
        async def attempt() -> list[Message]:
            try:
                return await self.source.receive(max_messages, _RECEIVE_TIMEOUT_S)
            except Exception:
                self._last_activity = time.monotonic()  # an unreachable source is not idle
                raise

        try:
            return await self.source_retrier.call(attempt, "source receive")
        except GaveUp:
            return []

    # ------------------------------------------------------------ preparing

    def _admit(self) -> None:
        if self.gate is not None and not self.drain.draining.is_set():
            self.gate.admit()
            self.metrics.inflight.set(self.busy)

    # ------------------------------------------------------------ engine events

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        assert self.gate is not None
        for out in outputs:
            job = self.table.running.get(out.request_id)
            if job is None:
                continue  # taken back after a failed step: already at the gate again
            self.gate.released(job)
            self.metrics.observe_output(out)
            if job.abort is None and out.error is None:
                self.failures.completed()  # the engine works: a failure streak is over
            if job.abort is AbortReason.DRAIN:
                self.settler.settle_later(job, Fate.HANDED_BACK)
            elif job.abort is AbortReason.REVOKED:
                self.settler.settle_later(job, Fate.REVOKED)
            else:
                self.settler.finish(job, out, expired=job.abort is AbortReason.EXPIRED)
        self._last_activity = time.monotonic()
        self._progress.set()

    def _on_step_error(self, exc: BaseException) -> None:
        """A step raised: its jobs go back through the gate (``step_failures``)."""
        assert self._thread is not None and self.gate is not None
        jobs = list(self.table.running.values())
        group: list[Job] = []
        for job in jobs:
            self.gate.released(job)
            assert job.request_id is not None
            self._thread.abort(job.request_id)  # its output, if any, is ignored
            if job.abort is AbortReason.DRAIN:
                self.settler.settle_later(job, Fate.HANDED_BACK)
            elif job.abort is AbortReason.REVOKED:
                self.settler.settle_later(job, Fate.REVOKED)
            elif job.abort is AbortReason.EXPIRED:
                self.settler.answer_error(job, BatchExpiredError(
                    f"deadline {job.deadline:.0f} passed while generating"))
            else:
                group.append(job)
        self.summary.step_failures += 1
        for job in self.failures.failed(group, len(jobs)):
            self._engine_error(job, exc)
        log.error("engine step failed (%d in a row, %d jobs sent back): %s",
                  self.failures.streak, len(group), exc)
        if self.failures.broken:
            self.metrics.set_problem("engine", True)
            self._fail(ExitCode.ENGINE, f"engine failed {self.failures.streak} steps in a row",
                       immediate=True)
        self._thread.resume()  # the aborts above are queued: the next step drops them
        self._progress.set()

    def _engine_error(self, job: Job, exc: BaseException | str) -> None:
        log.error("job failed the engine alone %d times: engine_error", job.solo_failures,
                  extra=job.log_ids())
        self.settler.answer_error(job, EngineError(
            f"the engine failed on this request {job.solo_failures} times when run alone: "
            f"{exc}"))

    def _on_engine_failure(self, why: str) -> None:
        """The watchdog's verdict: a hung step or a dead engine thread (exit 70)."""
        self._engine_hung = True
        self.metrics.set_problem("engine", True)
        self._fail(ExitCode.ENGINE, why, immediate=True)

    # ------------------------------------------------------------ other events

    def _on_revoke(self, msgs: list[Message]) -> None:
        assert self._thread is not None
        revoked = {msg.message_id for msg in msgs}
        for job in self.table:
            if job.msg.message_id not in revoked:
                continue
            if job.state is S.RUNNING and job.abort is None:
                job.abort = AbortReason.REVOKED
                assert job.request_id is not None
                self._thread.abort(job.request_id)
            elif job.state in AT_GATE:
                self.settler.settle_later(job, Fate.REVOKED)

    def _on_spot_notice(self, body: str) -> None:
        self.metrics.spot_interruptions.inc()
        self.drain.request(DrainReason.SPOT)

    async def _deadline_loop(self) -> None:
        assert self._thread is not None
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for job in list(self.table.running.values()):
                if job.abort is None and job.expired(now):
                    job.abort = AbortReason.EXPIRED
                    assert job.request_id is not None
                    self._thread.abort(job.request_id)

    async def _wait_progress(self, timeout: float) -> None:
        self._progress.clear()
        waits = [asyncio.ensure_future(self._progress.wait()),
                 asyncio.ensure_future(self.drain.immediate.wait())]
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()

    async def _wait_until(self, done: Callable[[], bool], until: float,
                          immediate_stops: bool = True) -> None:
        """Wait (on progress events) until ``done()`` or ``until`` (monotonic)."""
        while not done() and time.monotonic() < until:
            if immediate_stops and self.drain.immediate.is_set():
                return
            await self._wait_progress(min(0.1, max(0.0, until - time.monotonic())))

    async def _stats_loop(self) -> None:
        last = last_progress = time.monotonic()
        while True:
            await asyncio.sleep(_STATS_INTERVAL_S)
            now = time.monotonic()
            self._sample_stats(now - last)
            last = now
            if now - last_progress >= _PROGRESS_INTERVAL_S:
                last_progress = now
                s = self.summary
                log.info("progress: %d received, %d done, %d in flight, %d generated tokens, "
                         "kv %.0f%%", s.received, sum(s.completed.values()), self.busy,
                         s.generation_tokens, 100 * self._kv_usage)

    def _sample_stats(self, dt: float) -> None:
        stats = self.engine.stats()
        self._kv_usage = stats.kv_cache_usage_perc
        self.metrics.update_engine(stats)
        self.metrics.inflight.set(self.busy)
        self.metrics.uncommitted.set(self.source.uncommitted_count())
        self.summary.observe_engine(stats, dt, saturated=bool(self.table.ready))

    # ------------------------------------------------------------ drain

    async def _drain(self) -> float:
        """The drain's phases (``drain_phases``); returns when the close phase ends."""
        assert self._thread is not None and self.gate is not None
        self.metrics.draining.set(1)
        self.metrics.ready = False

        def store_until(at: float) -> None:
            self._store_until = at if self._store_until is None else min(self._store_until, at)

        self._store_until = None
        return await drain_phases(self.table, self.settler, self.tasks, self.gate,
                                  self._thread, self.admission, self.budget, self.drain,
                                  self._wait_until, store_until)
