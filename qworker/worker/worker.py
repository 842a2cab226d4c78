"""The worker loop: source -> prepare -> admission -> engine thread -> record -> sink -> ack.

Per message: prepare it on a thread pool (parse, tokenize once, validate: a dead
letter, an error record, or a job ready for the engine); admit it when the KV pool
can take it; when the engine finishes it, build the record (thread pool), store it
(``ResultWriter``) and then ``source.ack``. A job leaves the worker only through ack
(its record is stored), ``dead_letter`` or ``abandon`` (redelivered later, never
acked). Where each unacked job is lives in ``JobTable``.

Failures (docs/operations.md): a failing source, sink or dead-letter target is retried
with backoff for its outage budget, then the worker stops with exit 69; a failed
engine step sends its jobs back through the gate in bisected groups until the job
that fails on its own is found (``engine_error`` after ``max_job_attempts`` solo
failures); steps that keep failing, a step past ``engine_step_timeout`` or a dead
engine thread stop the worker with exit 70, every unacked job handed back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from typing import Any

from qworker.config import WorkerSettings
from qworker.engine.outputs import RequestOutput
from qworker.errors import BatchExpiredError
from qworker.schema import error_of, error_record_for
from qworker.worker.admission import Admission
from qworker.worker.dead_letters import DeadLetters
from qworker.worker.drain import DrainControl, DrainReason
from qworker.worker.engine_thread import EngineLike, EngineThread, watchdog
from qworker.worker.exit_codes import ExitCode
from qworker.worker.failures import SourceUnavailableError
from qworker.worker.gate import Gate
from qworker.worker.job_table import AbortReason, InFlightJob, JobTable, ReadyJob
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.requests import (
    Prepared,
    Unserved,
    engine_error_record,
    prepare,
    record_for,
    token_decoder,
)
from qworker.worker.result_writer import ResultWriter, Stored
from qworker.worker.sinks.base import Sink
from qworker.worker.source_start import Started, start_source
from qworker.worker.sources.base import Message, Source
from qworker.worker.spot import SpotPoller
from qworker.worker.step_failures import StepFailures
from qworker.worker.summary import RunSummary

log = logging.getLogger(__name__)

_RECEIVE_TIMEOUT_S = 0.25
_STATS_INTERVAL_S = 0.25
_PROGRESS_INTERVAL_S = 10.0
_ABORT_WAIT_S = 5.0
_MAX_RECEIVE = 64
_STORE_WAIT_S = 30.0  # finished results still being written (sink retries) at drain
_PREP_WAIT_S = 10.0  # messages still being prepared at drain
_PENDING_CHECK_S = 1.0  # --until-idle asks the source for pending work this often
_PENDING_TIMEOUT_S = 15.0
_PENDING_LOG_S = 10.0
_DRAIN_PENDING_S = 5.0
_JUDGE_AFTER_S = 1.0  # quiet this long with only deferred jobs: judge them
_SIGNALLED = (DrainReason.SIGNAL, DrainReason.SPOT)


def _ids(custom_id: str | None, msg: Message) -> dict[str, Any]:
    return {"custom_id": custom_id, "message_id": msg.message_id}


def _status(record: dict[str, Any]) -> str:
    """``success`` or the error code of a result line."""
    error = error_of(record)
    return "success" if error is None else str(error.get("code") or "engine_error")


class Worker:
    """One worker: drives ``engine`` with jobs from ``source``, results into ``sink``.

    ``run()`` returns when the drain finished (signal, spot notice, ``until_idle``,
    or a fatal failure); ``exit_code`` is then an ``ExitCode`` (docs/operations.md).
    Create and run it inside the event loop that will own it.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        engine: EngineLike,
        source: Source,
        sink: Sink,
        sink_prefix: str = "",
        metrics: WorkerMetrics | None = None,
        drain: DrainControl | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.source = source
        self.sink = sink
        self.sink_prefix = sink_prefix
        self.metrics = metrics or WorkerMetrics()
        self.metrics.set_model(engine.model_name)
        self.drain = drain or DrainControl()
        self.admission = Admission(settings.max_inflight_jobs, settings.admission_buffer_blocks)
        self.summary = RunSummary()
        self.exit_code = ExitCode.OK
        self.table = JobTable()
        self.writer = ResultWriter(
            sink, settings.sink_outage_seconds, self.drain, self.metrics,
            on_exhausted=lambda why: self._fail(ExitCode.UNAVAILABLE, why), prefix=sink_prefix,
        )
        self.source_outage = Outage("source", settings.source_outage_seconds,
                                    self.metrics.set_problem)
        self.dead_letters = DeadLetters(
            source, settings.source_outage_seconds, self.drain, self.metrics, self.summary,
            deadline=lambda: self.writer.drain_deadline,
            on_exhausted=lambda why: self._fail(ExitCode.UNAVAILABLE, why),
        )
        self._backoff = Backoff(first=0.2, cap=5.0)  # source, DLQ: retried at least every 5 s
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="qworker-prep")
        self._preparing: set[asyncio.Task[Any]] = set()
        self._progress = asyncio.Event()
        self.failures = StepFailures(self.table, settings.max_job_attempts)
        self._kv_usage = 0.0
        self._last_activity = time.monotonic()
        self._next_pending_check = 0.0
        self._next_pending_log = 0.0
        self._block_size = engine.stats().block_size
        self._decode = token_decoder(engine)
        self._thread: EngineThread | None = None
        self.gate: Gate | None = None
        self._engine_hung = False

    @property
    def sink_down(self) -> bool:
        """True while the sink keeps failing: receiving pauses until a write succeeds."""
        return self.writer.sink_down

    @property
    def busy(self) -> int:
        """Unacked jobs inside the worker (see ``JobTable.busy``)."""
        return self.table.busy

    # ------------------------------------------------------------ lifecycle

    async def run(self) -> RunSummary:
        """Serve until drained; see the class docstring."""
        loop = asyncio.get_running_loop()
        self._thread = EngineThread(
            self.engine, loop, self._on_outputs, self._on_step_error, self._block_size
        )
        self.gate = Gate(self.table, self.admission, self.engine, self._thread,
                         self._block_size, self._record_error)
        self.source.on_revoke = self._on_revoke
        try:
            if not await self._start_source():
                return self.summary
        except BaseException:
            self._pool.shutdown(wait=False)
            with contextlib.suppress(Exception):
                await self.sink.close()
            raise
        # Joining a consumer group can take seconds: that wait is not idle time.
        self._last_activity = time.monotonic()
        self._thread.start()
        helpers = [
            asyncio.create_task(self._stats_loop()),
            asyncio.create_task(self._deadline_loop()),
            asyncio.create_task(watchdog(self._thread, self.settings.engine_step_timeout,
                                         self._on_engine_failure)),
        ]
        if self.settings.spot_metadata_url:
            poller = SpotPoller(
                self.settings.spot_metadata_url,
                self.settings.spot_poll_seconds,
                self._on_spot_notice,
            )
            helpers.append(asyncio.create_task(poller.run()))
        self.metrics.ready = True
        try:
            await self._admit_loop()
            await self._drain()
            if self.exit_code == ExitCode.OK and self.drain.reason in _SIGNALLED:
                self.exit_code = await self._drain_exit_code()
        finally:
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self._thread.stop(0.5 if self._engine_hung else 10.0)
            self._sample_stats(0.0)
            await self.sink.close()
            await self.source.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.metrics.ready = False
            # An idle exit waited until_idle seconds for nothing: leave that out of the rates.
            idle = self.drain.reason is DrainReason.IDLE
            self.summary.finished = self._last_activity if idle else time.monotonic()
            self.summary.drain_reason = self.drain.reason.value if self.drain.reason else None
        return self.summary

    async def _start_source(self) -> bool:
        """``start_source``; False when the worker must stop without serving."""
        started = await start_source(self.source, self.drain, self.source_outage,
                                     self._backoff, self.settings.drain_seconds)
        if started is Started.STARTED:
            return True
        if started is Started.UNREACHABLE:
            self._fail(ExitCode.UNAVAILABLE, "source unreachable at start")
        else:
            self.exit_code = ExitCode.DRAINED  # nothing served, but the source may hold work
        await self.sink.close()
        self.summary.finished = time.monotonic()
        self.summary.drain_reason = self.drain.reason.value if self.drain.reason else None
        return False

    def _fail(self, code: ExitCode, why: str, immediate: bool = False) -> None:
        """Stop with ``code``: a graceful drain (finished work is still stored) or at once."""
        log.error("%s: stopping (exit %d)", why, code)
        if self.exit_code == ExitCode.OK:
            self.exit_code = code
        if immediate:
            self.drain.request_immediate(DrainReason.FATAL)
        else:
            self.drain.request(DrainReason.FATAL)

    async def _drain_exit_code(self) -> ExitCode:
        """After a signal or spot drain: 0 only if no work was left, here or at the source."""
        if self.summary.abandoned:
            return ExitCode.DRAINED
        try:
            pending = await asyncio.wait_for(self.source.pending_work(), _DRAIN_PENDING_S)
        except Exception as exc:
            log.warning("cannot tell whether the source has pending work: %r", exc)
            return ExitCode.DRAINED
        return ExitCode.OK if pending == 0 else ExitCode.DRAINED

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
                for msg in msgs:
                    self.table.spawn(self.source.abandon(msg))
                break
            if msgs:
                self._last_activity = time.monotonic()
                self._start_preparing(msgs)
            elif (self.table.deferred and self.busy == len(self.table.deferred)
                  and time.monotonic() - self._last_activity >= _JUDGE_AFTER_S):
                for job in self.failures.judge_deferred():
                    self._engine_error(job, "no other job was left to run beside it")
            elif (
                until_idle is not None
                and self.busy == 0
                and time.monotonic() - self._last_activity >= until_idle
                and await self._source_drained()
            ):
                log.info(
                    "idle for %.1fs, nothing in flight and no pending work at the source: "
                    "stopping",
                    until_idle,
                )
                self.drain.request(DrainReason.IDLE)

    async def _receive(self, max_messages: int) -> list[Message]:
        """``source.receive`` riding out an unreachable source for its outage budget."""
        try:
            msgs = await self.source.receive(max_messages, _RECEIVE_TIMEOUT_S)
        except Exception as exc:
            self._last_activity = time.monotonic()  # an unreachable source is not idle
            if isinstance(exc, SourceUnavailableError) and exc.fatal:
                self._fail(ExitCode.UNAVAILABLE, f"source cannot go on: {exc}")
                return []
            down_for = self.source_outage.failed(exc)
            if self.source_outage.exhausted():
                self._fail(ExitCode.UNAVAILABLE,
                           f"source unreachable for {down_for:.0f}s: {exc}")
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.drain.draining.wait(),
                                           self._backoff.delay(self.source_outage.failures))
            return []
        self.source_outage.recovered()
        return msgs

    async def _source_drained(self) -> bool:
        """True when the source reports no pending work; checked at most once a second.

        Messages another (or a killed) worker holds are pending work: ``--until-idle``
        waits for them. A source that cannot answer is never idle (and counts toward
        its outage budget).
        """
        now = time.monotonic()
        if now < self._next_pending_check:
            return False
        self._next_pending_check = now + _PENDING_CHECK_S
        try:
            pending = await asyncio.wait_for(self.source.pending_work(), _PENDING_TIMEOUT_S)
        except Exception as exc:
            log.warning("cannot tell whether the source has pending work: %r", exc)
            down_for = self.source_outage.failed(exc)
            if self.source_outage.exhausted():
                self._fail(ExitCode.UNAVAILABLE, f"source unreachable for {down_for:.0f}s: {exc}")
            return False
        self.source_outage.recovered()
        if pending > 0:
            if now >= self._next_pending_log:
                self._next_pending_log = now + _PENDING_LOG_S
                log.info("idle here, but the source reports %d pending messages: waiting", pending)
            return False
        return True

    # ------------------------------------------------------------ preparing

    def _start_preparing(self, msgs: list[Message]) -> None:
        self.summary.received += len(msgs)
        self.metrics.jobs_received.inc(len(msgs))
        task = self.table.spawn(self._prepare(msgs), self._preparing.discard)
        self._preparing.add(task)

    def _prepare_sync(self, bodies: list[bytes]) -> list[Prepared | Unserved]:
        # On the prep pool: JSON parsing, chat templates and tokenization stay off the loop.
        limit = self.settings.max_job_bytes
        return [prepare(self.engine, body, limit) for body in bodies]

    async def _prepare(self, msgs: list[Message]) -> None:
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(
            self._pool, self._prepare_sync, [m.body for m in msgs]
        )
        for msg, outcome in zip(msgs, outcomes, strict=True):
            if isinstance(outcome, Prepared):
                self.table.ready.append(ReadyJob(msg, outcome))
            elif outcome.dead_letter is not None:
                log.warning("dead letter: %s", outcome.dead_letter, extra=_ids(None, msg))
                self.table.spawn(self.dead_letters.send(msg, outcome.dead_letter))
            else:
                assert outcome.record is not None
                cid = outcome.custom_id or ""
                log.warning("%s: not served", outcome.code, extra=_ids(cid, msg))
                self.table.spawn(self._store(msg, cid, outcome.batch_id, outcome.record,
                                             outcome.fingerprint))
        self._admit()

    def _admit(self) -> None:
        if self.gate is not None and not self.drain.draining.is_set():
            self.gate.admit()
            self.metrics.inflight.set(self.busy)

    # ------------------------------------------------------------ results

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        assert self.gate is not None
        for out in outputs:
            entry = self.table.finish(out.request_id)
            if entry is None:
                continue  # abandoned after a failed step: already back at the gate
            self.gate.released(out.request_id, entry.growth)
            self.metrics.observe_output(out)
            if entry.abort_reason is None and out.error is None:
                self.failures.completed()  # the engine works: a failure streak is over
            self._complete(entry, out)
        self._last_activity = time.monotonic()
        self._progress.set()

    def _complete(self, entry: InFlightJob, out: RequestOutput) -> None:
        job, msg = entry.ready, entry.ready.msg
        if entry.abort_reason is AbortReason.DRAIN:
            log.info("abandoned at drain", extra=_ids(job.custom_id, msg))
            self.summary.abandoned += 1
            self.table.spawn(self.source.abandon(msg))
            return
        if entry.abort_reason is AbortReason.REVOKED:
            log.info("dropped: partition revoked", extra=_ids(job.custom_id, msg))
            return
        expired = entry.abort_reason is AbortReason.EXPIRED
        self.table.spawn(self._finish(job, out, expired))

    async def _finish(self, job: ReadyJob, out: RequestOutput, expired: bool) -> None:
        loop = asyncio.get_running_loop()
        spec = job.prepared.job
        record = await loop.run_in_executor(
            self._pool, record_for, spec, out, self.engine.model_name, self._decode, expired
        )
        await self._store(job.msg, spec.custom_id, spec.batch_id, record, job.prepared.fingerprint)

    def _record_error(self, job: ReadyJob, exc: BaseException) -> None:
        spec = job.prepared.job
        record = error_record_for(spec.custom_id, spec.batch_id, exc, spec.metadata)
        log.warning("%s: %s", _status(record), exc, extra=_ids(spec.custom_id, job.msg))
        self.table.spawn(self._store(job.msg, spec.custom_id, spec.batch_id, record,
                                     job.prepared.fingerprint))

    async def _store(self, msg: Message, custom_id: str, batch_id: str | None,
                     record: dict[str, Any], fingerprint: str | None) -> None:
        """Write the record (``ResultWriter.store_result``), then ack; never ack unstored."""
        ids = _ids(custom_id, msg)
        status = _status(record)
        stored, key = await self.writer.store_result(custom_id, batch_id, record, fingerprint,
                                                     ids)
        if stored is Stored.UNSTORED:
            self.summary.abandoned += 1
            await self.source.abandon(msg)
            return
        if stored is Stored.DUPLICATE:
            self.summary.duplicates += 1
            self.metrics.jobs_duplicate.inc()
            log.info("result already stored (duplicate) at %s", key, extra=ids)
        elif stored is Stored.CONFLICT:
            self.summary.conflicts += 1
            status = "duplicate_custom_id"
        await self.source.ack(msg)
        self.summary.completed[status] += 1
        self.metrics.job_completed(status, batch_id)
        if stored is Stored.WRITTEN:
            log.info("%s -> %s", status, key, extra=ids)

    # ------------------------------------------------------------ engine failures

    def _on_step_error(self, exc: BaseException) -> None:
        """A step raised: its jobs go back through the gate (``step_failures``)."""
        assert self._thread is not None and self.gate is not None
        entries = self.table.take_all_inflight()
        group: list[ReadyJob] = []
        for entry in entries:
            self.gate.released(entry.request_id, entry.growth)
            self._thread.abort(entry.request_id)  # its output, if any, is ignored
            reason = entry.abort_reason
            if reason is AbortReason.DRAIN:
                self.summary.abandoned += 1
                self.table.spawn(self.source.abandon(entry.ready.msg))
            elif reason is AbortReason.EXPIRED:
                spec = entry.ready.prepared.job
                self._record_error(entry.ready, BatchExpiredError(
                    f"deadline {spec.deadline:.0f} passed while generating"))
            elif reason is not AbortReason.REVOKED:
                group.append(entry.ready)
        self.summary.step_failures += 1
        for job in self.failures.failed(group, len(entries)):
            self._engine_error(job, exc)
        log.error("engine step failed (%d in a row, %d jobs sent back): %s",
                  self.failures.streak, len(group), exc)
        if self.failures.broken:
            self.metrics.set_problem("engine", True)
            self._fail(ExitCode.ENGINE, f"engine failed {self.failures.streak} steps in a row",
                       immediate=True)
        self._thread.resume()  # the aborts above are queued: the next step drops them
        self._progress.set()

    def _engine_error(self, job: ReadyJob, exc: BaseException | str) -> None:
        spec, attempts = job.prepared.job, job.prepared.solo_failures
        log.error("job failed the engine alone %d times: engine_error", attempts,
                  extra=_ids(spec.custom_id, job.msg))
        record = engine_error_record(spec, f"the engine failed on this request {attempts} "
                                     f"times when run alone: {exc}")
        self.table.spawn(self._store(job.msg, spec.custom_id, spec.batch_id, record,
                                     job.prepared.fingerprint))

    def _on_engine_failure(self, why: str) -> None:
        """The watchdog's verdict: a hung step or a dead engine thread (exit 70)."""
        self._engine_hung = True
        self.metrics.set_problem("engine", True)
        self._fail(ExitCode.ENGINE, why, immediate=True)

    # ------------------------------------------------------------ events

    def _on_revoke(self, msgs: list[Message]) -> None:
        assert self._thread is not None
        for entry in self.table.revoke(msg.message_id for msg in msgs):
            if entry.abort_reason is None:
                entry.abort_reason = AbortReason.REVOKED
                self._thread.abort(entry.request_id)

    def _on_spot_notice(self, body: str) -> None:
        self.metrics.spot_interruptions.inc()
        self.drain.request(DrainReason.SPOT)

    async def _wait_progress(self, timeout: float) -> None:
        self._progress.clear()
        waits = [
            asyncio.ensure_future(self._progress.wait()),
            asyncio.ensure_future(self.drain.immediate.wait()),
        ]
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()

    async def _deadline_loop(self) -> None:
        assert self._thread is not None
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for entry in list(self.table.inflight.values()):
                deadline = entry.ready.prepared.job.deadline
                if deadline is not None and deadline <= now and entry.abort_reason is None:
                    entry.abort_reason = AbortReason.EXPIRED
                    self._thread.abort(entry.request_id)

    async def _stats_loop(self) -> None:
        last = time.monotonic()
        last_progress = last
        while True:
            await asyncio.sleep(_STATS_INTERVAL_S)
            now = time.monotonic()
            self._sample_stats(now - last)
            last = now
            if now - last_progress >= _PROGRESS_INTERVAL_S:
                last_progress = now
                s = self.summary
                log.info(
                    "progress: %d received, %d done, %d in flight, %d generated tokens, kv %.0f%%",
                    s.received,
                    sum(s.completed.values()),
                    self.busy,
                    s.generation_tokens,
                    100 * self._kv_usage,
                )

    def _sample_stats(self, dt: float) -> None:
        stats = self.engine.stats()
        self._kv_usage = stats.kv_cache_usage_perc
        self.metrics.update_engine(stats)
        self.metrics.inflight.set(self.busy)
        self.metrics.uncommitted.set(self.source.uncommitted_count())
        self.summary.observe_engine(stats, dt, saturated=bool(self.table.ready))

    # ------------------------------------------------------------ drain

    async def _drain(self) -> None:
        assert self._thread is not None
        self.metrics.draining.set(1)
        self.metrics.ready = False
        reason = self.drain.reason
        immediate = self.drain.immediate
        self.writer.drain_deadline = time.monotonic() + self.settings.drain_seconds
        if self._preparing:  # CPU work only: let it land in the table first
            await asyncio.wait(set(self._preparing), timeout=_PREP_WAIT_S)
        # Jobs that never started go back first, for other workers.
        for job in self.table.take_waiting():
            self.summary.abandoned += 1
            await self.source.abandon(job.msg)
        if self.table.inflight and not immediate.is_set():
            log.info("draining: %d jobs in flight, up to %.0fs", len(self.table.inflight),
                     self.settings.drain_seconds)
            until = time.monotonic() + self.settings.drain_seconds
            while self.table.inflight and time.monotonic() < until and not immediate.is_set():
                await self._wait_progress(0.1)
        for entry in self.table.inflight.values():
            if entry.abort_reason is None:
                entry.abort_reason = AbortReason.DRAIN
                self._thread.abort(entry.request_id)
        until = time.monotonic() + (1.0 if immediate.is_set() else _ABORT_WAIT_S)
        while self.table.inflight and time.monotonic() < until:
            await self._wait_progress(0.05)
        for entry in self.table.take_all_inflight():
            self.summary.abandoned += 1
            await self.source.abandon(entry.ready.msg)
        self.admission.final_sum = 0
        if self.table.tasks:
            budget = 2.0 if immediate.is_set() else _STORE_WAIT_S
            _, pending = await asyncio.wait(set(self.table.tasks), timeout=budget)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        log.info("drained (%s)", reason.value if reason else "done")
