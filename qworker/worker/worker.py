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
import math
import time
import uuid
from typing import Any

from qworker.config import WorkerSettings
from qworker.engine.outputs import RequestOutput
from qworker.errors import BatchExpiredError
from qworker.schema import (
    conflict_key,
    conflict_record,
    error_of,
    error_record_for,
    result_key,
)
from qworker.worker.admission import Admission
from qworker.worker.drain import DrainControl, DrainReason
from qworker.worker.engine_thread import EngineLike, EngineThread
from qworker.worker.exit_codes import ExitCode
from qworker.worker.failures import SourceUnavailableError, StartupError
from qworker.worker.job_table import AbortReason, InFlightJob, JobTable, ReadyJob
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.requests import (
    Prepared,
    Unserved,
    engine_error_record,
    expired_error,
    prepare,
    record_for,
    token_decoder,
)
from qworker.worker.result_writer import Conflict, ResultWriter, Stored
from qworker.worker.sinks.base import Sink
from qworker.worker.sources.base import Message, Source
from qworker.worker.spot import SpotPoller
from qworker.worker.summary import RunSummary

log = logging.getLogger(__name__)

_RECEIVE_TIMEOUT_S = 0.25
_STATS_INTERVAL_S = 0.25
_PROGRESS_INTERVAL_S = 10.0
_WATCHDOG_INTERVAL_S = 0.5
_ABORT_WAIT_S = 5.0
_MAX_RECEIVE = 64
_STORE_WAIT_S = 30.0  # finished results still being written (sink retries) at drain
_PREP_WAIT_S = 10.0  # messages still being prepared at drain
_START_CLOSE_S = 5.0  # longest wait to close a source whose start a drain cancelled
_PENDING_CHECK_S = 1.0  # --until-idle asks the source for pending work this often
_PENDING_TIMEOUT_S = 15.0
_PENDING_LOG_S = 10.0
_DRAIN_PENDING_S = 5.0
_JUDGE_AFTER_S = 1.0  # quiet this long with only deferred jobs: judge them
#: Failed steps in a row, beyond what bisecting the jobs and retrying the last one
#: alone explain, before the engine counts as broken (exit 70).
MAX_STEP_FAILURES = 3
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
            on_exhausted=lambda why: self._fail(ExitCode.UNAVAILABLE, why),
        )
        self.source_outage = Outage("source", settings.source_outage_seconds,
                                    self.metrics.set_problem)
        self.dlq_outage = Outage("dead_letter", settings.source_outage_seconds,
                                 self.metrics.set_problem)
        self._backoff = Backoff(first=0.2, cap=5.0)  # source, DLQ: retried at least every 5 s
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="qworker-prep")
        self._preparing: set[asyncio.Task[Any]] = set()
        self._isolated: set[str] = set()  # request ids of a suspect group under test
        self._progress = asyncio.Event()
        self._fail_streak = 0  # failed steps since a job last completed
        self._streak_width = 1
        self._completions = 0  # jobs the engine completed normally
        self._kv_usage = 0.0
        self._last_activity = time.monotonic()
        self._next_pending_check = 0.0
        self._next_pending_log = 0.0
        self._block_size = engine.stats().block_size
        self._decode = token_decoder(engine)
        self._thread: EngineThread | None = None
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
        self.source.on_revoke = self._on_revoke
        try:
            if not await self._start_source():
                return self.summary
        except BaseException:
            self._pool.shutdown(wait=False)
            raise
        # Joining a consumer group can take seconds: that wait is not idle time.
        self._last_activity = time.monotonic()
        self._thread.start()
        helpers = [
            asyncio.create_task(self._stats_loop()),
            asyncio.create_task(self._deadline_loop()),
            asyncio.create_task(self._watchdog_loop()),
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
        """``source.start()`` raced against a drain and retried through an outage.

        False when a drain cancelled it (exit 75: the source may hold work) or the
        source stayed unreachable for its outage budget (exit 69). A ``StartupError``
        (missing queue or topic) propagates: exit 1.
        """
        attempt = 0
        while True:
            start = asyncio.ensure_future(self.source.start())
            drained = asyncio.ensure_future(self.drain.draining.wait())
            try:
                await asyncio.wait({start, drained}, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # run() itself cancelled: take the start down with it
                start.cancel()
                raise
            finally:
                drained.cancel()
            if not start.done():
                log.warning("drain requested while the source was starting: not serving")
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await start
                self.exit_code = ExitCode.DRAINED
                break
            try:
                start.result()
                self.source_outage.recovered()
                return True
            except StartupError:
                await self._close_unstarted()
                await self.sink.close()
                raise
            except Exception as exc:  # unreachable for now: retried within the budget
                attempt += 1
                self.source_outage.failed(exc)
                if self.source_outage.exhausted():
                    self._fail(ExitCode.UNAVAILABLE, f"source unreachable at start: {exc}")
                    break
                log.warning("source start failed (attempt %d), retrying: %s", attempt, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.drain.draining.wait(),
                                           self._backoff.delay(attempt))
        await self._close_unstarted()
        await self.sink.close()
        self.summary.finished = time.monotonic()
        self.summary.drain_reason = self.drain.reason.value if self.drain.reason else None
        return False

    async def _close_unstarted(self) -> None:
        budget = min(_START_CLOSE_S, max(1.0, self.settings.drain_seconds))
        try:
            await asyncio.wait_for(self.source.close(), budget)
        except TimeoutError:
            log.warning("source did not close within %.1fs after a cancelled start", budget)
        except Exception as exc:
            log.warning("closing the source after a cancelled start failed: %r", exc)

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
            self._admit_ready()
            room = self._room()
            if room == 0 or self.writer.sink_down or self.dlq_outage.down:
                # A failing sink or DLQ: finished work waits for it, so take no new work.
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
                self._judge_deferred()
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

    def _room(self) -> int:
        if self.table.ready or self.table.suspects or self._isolated:
            return 0
        assert self._thread is not None
        stats = self.engine.stats()
        # Deferred jobs wait for others to run: they must not take those others' places.
        active = self.busy - len(self.table.deferred)
        return self.admission.room(stats, self._thread.pending_blocks, active)

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
                self.table.spawn(self._dead_letter(msg, outcome.dead_letter))
            else:
                assert outcome.record is not None
                cid = outcome.custom_id or ""
                log.warning("%s: not served", outcome.code, extra=_ids(cid, msg))
                self.table.spawn(self._store(msg, cid, outcome.batch_id, outcome.record,
                                             outcome.fingerprint))
        self._admit_ready()

    # ------------------------------------------------------------ admission

    def _admit_ready(self) -> None:
        """Submit ready jobs while the KV pool can take them (see ``admission``).

        Suspect jobs (from a failed step) go first, one group at a time and alone in
        the engine, so a job that breaks steps is found by halving its group.
        """
        thread = self._thread
        if thread is None or self._isolated or self.drain.draining.is_set():
            return
        if self.table.suspects:
            if self.table.inflight:
                return  # let the engine empty first: the group must run alone
            for job in self.table.suspects.popleft():
                rid = self._submit(job, isolated=True)
                if rid is not None:
                    self._isolated.add(rid)
            return
        while self.table.ready:
            job = self.table.ready[0]
            n_tokens = len(job.prepared.token_ids)
            params = job.prepared.job.params
            need = max(1, math.ceil(n_tokens / self._block_size))
            step = thread.steps
            growth = self.admission.growth(
                n_tokens, params.max_tokens, params.n, self.engine.max_model_len, step
            )
            admitted = [entry.growth for entry in self.table.inflight.values()]
            if not self.admission.fits(
                self.engine.stats(), thread.pending_blocks, need, admitted, growth, step,
                self._block_size,
            ):
                return
            self.table.ready.popleft()
            self._submit(job, growth=growth)

    def _submit(self, job: ReadyJob, growth: Any = None, isolated: bool = False) -> str | None:
        assert self._thread is not None
        msg, prepared = job.msg, job.prepared
        spec = prepared.job
        expired = expired_error(spec)
        if expired is not None:
            self._record_error(job, expired)
            return None
        n_tokens = len(prepared.token_ids)
        if growth is None:
            growth = self.admission.growth(n_tokens, spec.params.max_tokens, spec.params.n,
                                           self.engine.max_model_len, self._thread.steps)
        request_id = uuid.uuid4().hex
        try:
            self._thread.submit(request_id, prepared.text, prepared.token_ids, spec.params,
                                msg.received_at)
        except Exception as exc:  # any rejection becomes the job's record
            self._record_error(job, exc)
            return None
        self.admission.observe_prompt(n_tokens, self._block_size)
        self.table.admit(job, request_id, growth)
        self.admission.admitted(growth, self._block_size)
        self.metrics.inflight.set(self.busy)
        log.debug("admitted as %s%s", request_id, " (alone, after a failed step)" if isolated
                  else "", extra=_ids(spec.custom_id, msg))
        return request_id

    # ------------------------------------------------------------ results

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            entry = self.table.finish(out.request_id)
            if entry is None:
                continue  # abandoned after a failed step: already back at the gate
            self._isolated.discard(out.request_id)
            self.admission.released(entry.growth, self._block_size)
            self.metrics.observe_output(out)
            if entry.abort_reason is None and out.error is None:
                self._completions += 1  # the engine works: a failure streak is over
                self._fail_streak = 0
                if self.table.deferred:  # the proof they waited for: test them again
                    self.table.suspects.extend([job] for job in self.table.deferred)
                    self.table.deferred = []
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
        """Write the record, then ack; a record that cannot be stored is never acked.

        A key that already holds another request's answer (a different fingerprint)
        gets this job's ``duplicate_custom_id`` record under ``_conflicts/`` instead:
        the stored answer is kept, and nothing is replaced silently.
        """
        key = result_key(self.sink_prefix, batch_id, custom_id)
        ids = _ids(custom_id, msg)
        status = _status(record)

        def conflict_for(stored_fingerprint: str | None) -> Conflict:
            assert fingerprint is not None
            return Conflict(
                conflict_key(self.sink_prefix, batch_id, custom_id, fingerprint),
                conflict_record(custom_id, batch_id, fingerprint, stored_fingerprint,
                                record.get("metadata")),
            )

        stored = await self.writer.store(key, record, fingerprint, conflict_for, ids)
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

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        """Dead-letter ``msg``, retried through a failing DLQ; never dropped, never acked around.

        Given up (the message abandoned, redelivered later) only when the drain runs out
        or the DLQ has failed for the source outage budget (then exit 69).
        """
        attempt = 0
        while True:
            try:
                await self.source.dead_letter(msg, reason)
                break
            except Exception as exc:
                attempt += 1
                now = time.monotonic()
                self.dlq_outage.failed(exc, now)
                deadline = self.writer.drain_deadline
                exhausted = self.dlq_outage.exhausted(now)
                if exhausted or self.drain.immediate.is_set() or (
                        deadline is not None and now >= deadline):
                    log.error("dead letter not sent, message left unacked: %s", exc,
                              extra=_ids(None, msg))
                    self.summary.abandoned += 1
                    await self.source.abandon(msg)
                    if exhausted:
                        self._fail(ExitCode.UNAVAILABLE, f"dead-letter target failing for "
                                   f"{self.dlq_outage.down_for(now):.0f}s: {exc}")
                    return
                delay = self._backoff.delay(attempt)
                if deadline is not None:
                    delay = max(0.0, min(delay, deadline - now))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.drain.immediate.wait(), delay)
        self.dlq_outage.recovered()
        self.summary.dead_lettered += 1
        self.metrics.jobs_dead_lettered.inc()

    # ------------------------------------------------------------ engine failures

    def _on_step_error(self, exc: BaseException) -> None:
        """A step raised: its jobs go back through the gate, bisected; see the module."""
        assert self._thread is not None
        entries = self.table.take_all_inflight()
        if self._fail_streak == 0:
            self._streak_width = max(1, len(entries))
        self._fail_streak += 1
        self._isolated.clear()
        group: list[ReadyJob] = []
        for entry in entries:
            self.admission.released(entry.growth, self._block_size)
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
        log.error("engine step failed (%d in a row, %d jobs sent back): %s",
                  self._fail_streak, len(group), exc)
        self._requeue_suspects(group, exc)
        limit = (MAX_STEP_FAILURES + math.ceil(math.log2(self._streak_width))
                 + self.settings.max_job_attempts)
        if self._fail_streak >= limit:
            self.metrics.set_problem("engine", True)
            self._fail(ExitCode.ENGINE, f"engine failed {self._fail_streak} steps in a row",
                       immediate=True)
        self._thread.resume()  # the aborts above are queued: the next step drops them
        self._progress.set()

    def _requeue_suspects(self, group: list[ReadyJob], exc: BaseException) -> None:
        if len(group) > 1:
            half = len(group) // 2
            self.table.suspects.appendleft(group[half:])
            self.table.suspects.appendleft(group[:half])
            return
        if not group:
            return
        job = group[0]
        prepared = job.prepared
        if prepared.solo_failures == 0:
            prepared.completions_seen = self._completions
        prepared.solo_failures += 1
        attempts = prepared.solo_failures
        if attempts < self.settings.max_job_attempts:
            self.table.suspects.appendleft([job])
            return
        if self._completions == prepared.completions_seen:
            # No other job completed since this one first failed alone: the engine itself
            # may be broken. Let other jobs run first (a completion brings it back); if
            # they fail too, that is exit 70; if there are none, see _judge_deferred.
            self.table.deferred.append(job)
            return
        self._engine_error(job, attempts, exc)

    def _engine_error(self, job: ReadyJob, attempts: int, exc: BaseException | str) -> None:
        spec = job.prepared.job
        log.error("job failed the engine alone %d times: engine_error", attempts,
                  extra=_ids(spec.custom_id, job.msg))
        record = engine_error_record(spec, f"the engine failed on this request {attempts} "
                                     f"times when run alone: {exc}")
        job.prepared.solo_failures = 0
        self.table.spawn(self._store(job.msg, spec.custom_id, spec.batch_id, record,
                                     job.prepared.fingerprint))

    def _judge_deferred(self) -> None:
        """Nothing else left to run: jobs that failed alone get their engine_error now."""
        jobs, self.table.deferred = self.table.deferred, []
        for job in jobs:
            self._engine_error(job, job.prepared.solo_failures,
                               "no other job was left to run beside it")

    async def _watchdog_loop(self) -> None:
        """Exit 70 when the engine thread died or one step runs past ``engine_step_timeout``."""
        assert self._thread is not None
        limit = self.settings.engine_step_timeout
        while True:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            if not self._thread.alive:
                why = "the engine thread died"
            elif limit and self._thread.step_running_for() > limit:
                self._engine_hung = True
                why = (f"an engine step has run for {self._thread.step_running_for():.0f}s "
                       f"(engine_step_timeout {limit:.0f}s)")
            else:
                continue
            self.metrics.set_problem("engine", True)
            self._fail(ExitCode.ENGINE, why, immediate=True)
            return

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
        if stats.num_requests_running or stats.num_requests_waiting:
            self.summary.sample_kv(
                stats.kv_cache_usage_perc, dt, saturated=bool(self.table.ready)
            )
        self.summary.prompt_tokens = stats.prompt_tokens
        self.summary.generation_tokens = stats.generation_tokens
        self.summary.num_preemptions = stats.num_preemptions

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
        self._isolated.clear()
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
