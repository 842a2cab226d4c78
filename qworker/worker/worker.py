"""The worker loop: source -> admission -> engine thread -> record -> sink -> ack.

Per message: parse (dead letter | error record | engine request); when the engine
finishes it, build the record, ``sink.put`` it, then ``source.ack``. A job leaves
the worker only through ack (its record is stored), ``dead_letter`` or ``abandon``
(drain: redelivered later, never acked). Invalid jobs never stop the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

from qworker.config import WorkerSettings
from qworker.engine.outputs import RequestOutput
from qworker.errors import BatchExpiredError, QworkerError
from qworker.schema import (
    Job,
    JobKind,
    dumps,
    error_of,
    error_record_for,
    parse_job,
    result_key,
    success_record,
)
from qworker.worker.admission import Admission, Growth
from qworker.worker.drain import DrainControl, DrainReason
from qworker.worker.engine_thread import EngineLike, EngineThread
from qworker.worker.exit_codes import ExitCode
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.sinks.base import Sink
from qworker.worker.sources.base import Message, Source
from qworker.worker.spot import SpotPoller
from qworker.worker.summary import RunSummary

log = logging.getLogger(__name__)

_RECEIVE_TIMEOUT_S = 0.25
_STATS_INTERVAL_S = 0.25
_PROGRESS_INTERVAL_S = 10.0
_ABORT_WAIT_S = 5.0
_MAX_STEP_FAILURES = 3
_MAX_RECEIVE = 64
_STORE_WAIT_S = 30.0  # finished results still being written (sink retries) at drain
_MAX_RECEIVE_FAILURES = 8
# A result whose write failed (after the sink's own retries) is kept and written
# again after a backoff of 1, 2, 4 ... up to 15 s (jittered), until the sink has
# been failing for ``sink_outage_seconds``.
_SINK_RETRY_FIRST_S = 1.0
_SINK_RETRY_MAX_S = 15.0
_START_CLOSE_S = 5.0  # longest wait to close a source whose start a drain cancelled
_PENDING_CHECK_S = 1.0  # --until-idle asks the source for pending work this often
_PENDING_TIMEOUT_S = 15.0
_PENDING_LOG_S = 10.0
_DRAIN_PENDING_S = 5.0
_SIGNALLED = (DrainReason.SIGNAL, DrainReason.SPOT)


class AbortReason(Enum):
    """Why the worker aborted a request inside the engine."""

    EXPIRED = "expired"
    DRAIN = "drain"
    REVOKED = "revoked"
    ENGINE_ERROR = "engine_error"


@dataclass(slots=True)
class _Ready:
    """A parsed, tokenized job waiting at the admission gate (its message unacked)."""

    msg: Message
    job: Job
    prompt: str | list[int]
    n_tokens: int


@dataclass(slots=True)
class InFlightJob:
    """A job inside the engine, keyed by its engine request id."""

    msg: Message
    job: Job
    request_id: str
    growth: Growth
    abort_reason: AbortReason | None = None
    error: str | None = None


def _ids(custom_id: str | None, msg: Message) -> dict[str, Any]:
    return {"custom_id": custom_id, "message_id": msg.message_id}


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
        self.drain = drain or DrainControl()
        self.admission = Admission(settings.max_inflight_jobs, settings.admission_buffer_blocks)
        self.summary = RunSummary()
        self.exit_code = ExitCode.OK
        self._inflight: dict[str, InFlightJob] = {}
        self._ready: deque[_Ready] = deque()
        self._by_message: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._progress = asyncio.Event()
        self._step_failures = 0
        self._receive_failures = 0
        self._sink_down_since: float | None = None
        self._drain_deadline: float | None = None
        self._kv_usage = 0.0
        self._last_activity = time.monotonic()
        self._next_pending_check = 0.0
        self._next_pending_log = 0.0
        self._block_size = engine.stats().block_size
        tokenizer = getattr(engine, "tokenizer", None)
        self._decode = (lambda tid: tokenizer.decode([tid])) if tokenizer is not None else None
        self._thread: EngineThread | None = None

    @property
    def sink_down(self) -> bool:
        """True while the sink's last write failed: receiving pauses until one succeeds."""
        return self._sink_down_since is not None

    @property
    def busy(self) -> int:
        """Unacked jobs inside the worker: at the gate, in the engine, or being stored."""
        return len(self._ready) + len(self._inflight) + len(self._tasks)

    async def run(self) -> RunSummary:
        """Serve until drained; see the class docstring."""
        loop = asyncio.get_running_loop()
        self._thread = EngineThread(
            self.engine, loop, self._on_outputs, self._on_step_error, self._block_size
        )
        self.source.on_revoke = self._on_revoke
        if hasattr(self.sink, "on_retry"):
            self.sink.on_retry = lambda *_: self.metrics.sink_retries.inc()
        if not await self._start_source():
            return self.summary
        # Joining a consumer group can take seconds: that wait is not idle time.
        self._last_activity = time.monotonic()
        self._thread.start()
        helpers = [
            asyncio.create_task(self._stats_loop()),
            asyncio.create_task(self._deadline_loop()),
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
            self._thread.stop()
            self._sample_stats(0.0)
            await self.sink.close()
            await self.source.close()
            self.metrics.ready = False
            # An idle exit waited until_idle seconds for nothing: leave that out of the rates.
            idle = self.drain.reason is DrainReason.IDLE
            self.summary.finished = self._last_activity if idle else time.monotonic()
            self.summary.drain_reason = self.drain.reason.value if self.drain.reason else None
        return self.summary

    async def _start_source(self) -> bool:
        """``source.start()`` raced against a drain; False when a drain cancelled it.

        A group join or an unreachable broker can hold the start for as long as the
        client library likes; a SIGTERM meanwhile must still exit within the drain
        budget. Nothing was received yet, so the cancelled source is closed (bounded
        in time) and there is nothing to commit or abandon.
        """
        start = asyncio.ensure_future(self.source.start())
        drained = asyncio.ensure_future(self.drain.draining.wait())
        try:
            await asyncio.wait({start, drained}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # run() itself cancelled: take the start down with it
            start.cancel()
            raise
        finally:
            drained.cancel()
        if start.done():
            try:
                start.result()
            except BaseException:
                await self._close_unstarted()
                raise
            return True
        log.warning("drain requested while the source was starting: not serving")
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await start
        await self._close_unstarted()
        await self.sink.close()
        self.exit_code = ExitCode.DRAINED  # nothing served, but the source may hold work
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

    # ------------------------------------------------------------ admission

    async def _admit_loop(self) -> None:
        until_idle = self.settings.until_idle
        while not self.drain.draining.is_set():
            self._admit_ready()
            room = 0
            if not self._ready:
                stats = self.engine.stats()
                room = self.admission.room(stats, self._thread.pending_blocks, self.busy)
            if room == 0 or self.sink_down:
                # A failing sink: finished results wait for it, so take no new work.
                await self._wait_progress(0.05 if room == 0 else 0.25)
                continue
            msgs = await self._receive(min(room, _MAX_RECEIVE))
            if msgs and self.drain.draining.is_set():
                for msg in msgs:
                    self._spawn(self.source.abandon(msg))
                break
            for msg in msgs:
                self._prepare(msg)
            if msgs:
                self._last_activity = time.monotonic()
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

    async def _source_drained(self) -> bool:
        """True when the source reports no pending work; checked at most once a second.

        Messages another (or a killed) worker holds are pending work: ``--until-idle``
        waits for them. A source that cannot answer is never idle.
        """
        now = time.monotonic()
        if now < self._next_pending_check:
            return False
        self._next_pending_check = now + _PENDING_CHECK_S
        try:
            pending = await asyncio.wait_for(self.source.pending_work(), _PENDING_TIMEOUT_S)
        except Exception as exc:
            log.warning("cannot tell whether the source has pending work: %r", exc)
            return False
        if pending > 0:
            if now >= self._next_pending_log:
                self._next_pending_log = now + _PENDING_LOG_S
                log.info("idle here, but the source reports %d pending messages: waiting", pending)
            return False
        return True

    async def _receive(self, max_messages: int) -> list[Message]:
        """``source.receive`` that rides out transient failures, then gives up (exit 1)."""
        try:
            msgs = await self.source.receive(max_messages, _RECEIVE_TIMEOUT_S)
        except Exception as exc:  # the source could not reconnect by itself
            self._receive_failures += 1
            log.error("source receive failed (%d in a row): %s", self._receive_failures, exc)
            if self._receive_failures >= _MAX_RECEIVE_FAILURES:
                self._fail(ExitCode.UNAVAILABLE, "source keeps failing")
            else:
                await asyncio.sleep(min(5.0, 0.2 * 2**self._receive_failures))
            self._last_activity = time.monotonic()  # an unreachable source is not idle
            return []
        self._receive_failures = 0
        return msgs

    def _fail(self, code: ExitCode, why: str) -> None:
        """Stop with ``code`` after a graceful drain (finished work is still stored)."""
        log.error("%s: stopping (exit %d)", why, code)
        if self.exit_code == ExitCode.OK:
            self.exit_code = code
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

    def _prepare(self, msg: Message) -> None:
        """Parse and tokenize one message; queue it for the admission gate or record it."""
        self.summary.received += 1
        self.metrics.jobs_received.inc()
        parsed = parse_job(msg.body, self.settings.max_job_bytes)
        if parsed.dead_letter is not None:
            log.warning("dead letter: %s", parsed.dead_letter, extra=_ids(None, msg))
            self._spawn(self._dead_letter(msg, parsed.dead_letter))
            return
        custom_id = parsed.custom_id or ""
        if parsed.error is not None or parsed.job is None:
            exc = parsed.error or QworkerError("unparseable job")
            self._finish_error(msg, custom_id, parsed.batch_id, exc, None)
            return
        job = parsed.job
        try:
            if job.kind is JobKind.CHAT:
                prompt: str | list[int] = self.engine.encode_chat(job.messages or [])
            else:
                prompt = job.prompt or ""
        except Exception as exc:  # no tokenizer / template: the job's record says so
            self._finish_error(msg, custom_id, job.batch_id, exc, job.metadata)
            return
        n_tokens = self._count_tokens(prompt)
        self._ready.append(_Ready(msg, job, prompt, n_tokens))

    def _count_tokens(self, prompt: str | list[int]) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is not None:
            return len(tokenizer.encode(prompt))
        return len(prompt.encode("utf-8"))  # never fewer tokens than bytes/1; exact for echo

    def _admit_ready(self) -> None:
        """Submit prepared jobs while the KV pool can take them (see ``admission``)."""
        while self._ready:
            item = self._ready[0]
            params = item.job.params
            need = max(1, math.ceil(item.n_tokens / self._block_size))
            step = self._thread.steps
            growth = self.admission.growth(
                item.n_tokens, params.max_tokens, params.n, self.engine.max_model_len, step
            )
            admitted = [entry.growth for entry in self._inflight.values()]
            stats = self.engine.stats()
            if not self.admission.fits(
                stats, self._thread.pending_blocks, need, admitted, growth, step, self._block_size
            ):
                return
            self._ready.popleft()
            self._submit(item, growth)

    def _submit(self, item: _Ready, growth: Growth) -> None:
        msg, job = item.msg, item.job
        if job.deadline is not None and job.deadline <= time.time():
            exc = BatchExpiredError(f"deadline {job.deadline:.0f} passed before the job started")
            self._finish_error(msg, job.custom_id, job.batch_id, exc, job.metadata)
            return
        request_id = uuid.uuid4().hex
        try:
            self._thread.submit(request_id, item.prompt, job.params, msg.received_at, item.n_tokens)
        except Exception as exc:  # any rejection becomes the job's record
            self._finish_error(msg, job.custom_id, job.batch_id, exc, job.metadata)
            return
        self.admission.observe_prompt(item.n_tokens, self._block_size)
        self._inflight[request_id] = InFlightJob(msg, job, request_id, growth)
        self.admission.admitted(growth, self._block_size)
        self._by_message[msg.message_id] = request_id
        self.metrics.inflight.set(self.busy)
        log.debug("admitted as %s", request_id, extra=_ids(job.custom_id, msg))

    # ------------------------------------------------------------ results

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._step_failures = 0
        for out in outputs:
            entry = self._inflight.pop(out.request_id, None)
            if entry is None:
                continue
            self.admission.released(entry.growth, self._block_size)
            self._by_message.pop(entry.msg.message_id, None)
            self.metrics.observe_output(out)
            self._complete(entry, out)
        self._last_activity = time.monotonic()
        self._progress.set()

    def _complete(self, entry: InFlightJob, out: RequestOutput) -> None:
        job, msg = entry.job, entry.msg
        aborted = any(c.finish_reason == "abort" for c in out.outputs)
        if out.error is not None:
            exc: BaseException = QworkerError(out.error)
        elif entry.abort_reason is AbortReason.ENGINE_ERROR:
            exc = QworkerError(entry.error or "engine step failed")
        elif entry.abort_reason is AbortReason.EXPIRED:
            exc = BatchExpiredError(f"deadline {job.deadline:.0f} passed while generating")
        elif entry.abort_reason is AbortReason.DRAIN:
            log.info("abandoned at drain", extra=_ids(job.custom_id, msg))
            self.summary.abandoned += 1
            self._spawn(self.source.abandon(msg))
            return
        elif entry.abort_reason is AbortReason.REVOKED:
            log.info("dropped: partition revoked", extra=_ids(job.custom_id, msg))
            return
        elif aborted:
            exc = QworkerError("request aborted by the engine")
        else:
            record = success_record(job, out, self.engine.model_name, self._decode)
            self._spawn(self._store(msg, job.custom_id, job.batch_id, record, "success"))
            return
        self._finish_error(msg, job.custom_id, job.batch_id, exc, job.metadata)

    def _finish_error(
        self,
        msg: Message,
        custom_id: str,
        batch_id: str | None,
        exc: BaseException,
        metadata: dict | None,
    ) -> None:
        record = error_record_for(custom_id, batch_id, exc, metadata)
        error = error_of(record) or {}
        code = error.get("code") or "engine_error"
        log.warning("%s: %s", code, error.get("message"), extra=_ids(custom_id, msg))
        self._spawn(self._store(msg, custom_id, batch_id, record, code))

    async def _store(
        self, msg: Message, custom_id: str, batch_id: str | None, record: dict, status: str
    ) -> None:
        """Write the record, then ack; a failing sink is retried, never acked around.

        The record is kept and written again with backoff while the sink fails (and
        receiving pauses, see ``sink_down``). Only when the sink has failed for
        ``sink_outage_seconds`` (or an immediate stop) is the job abandoned, unacked.
        """
        key = result_key(self.sink_prefix, batch_id, custom_id)
        body = dumps(record)
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                written = await self.sink.put(key, body)
                break
            except Exception as exc:  # unstored: keep it and try again
                attempt += 1
                self.summary.sink_failures += 1
                if not await self._sink_failed(msg, custom_id, exc, attempt):
                    return
        if self._sink_down_since is not None:
            log.warning(
                "sink writes succeed again after %.1fs: receiving resumes",
                time.monotonic() - self._sink_down_since,
            )
            self._sink_down_since = None
        self.metrics.sink_put_seconds.observe(time.monotonic() - started)
        if not written:
            self.summary.duplicates += 1
            self.metrics.jobs_duplicate.inc()
            log.info("result already stored (duplicate) at %s", key, extra=_ids(custom_id, msg))
        await self.source.ack(msg)
        self.summary.completed[status] += 1
        self.metrics.jobs_completed.labels(status=status).inc()
        if written:
            log.info("%s -> %s", status, key, extra=_ids(custom_id, msg))

    async def _sink_failed(
        self, msg: Message, custom_id: str, exc: Exception, attempt: int
    ) -> bool:
        """Back off after a failed write; False when the job was given up (abandoned)."""
        now = time.monotonic()
        if self._sink_down_since is None:
            self._sink_down_since = now
            log.error(
                "sink write failed: receiving paused, results retried for up to %.0fs: %s",
                self.settings.sink_outage_seconds,
                exc,
            )
        down_for = now - self._sink_down_since
        give_up = down_for >= self.settings.sink_outage_seconds
        # Draining: no new attempt once the drain budget is spent; the job stays unacked.
        deadline = self._drain_deadline
        if give_up or self.drain.immediate.is_set() or (deadline is not None and now >= deadline):
            log.error("sink put failed, job left unacked: %s", exc, extra=_ids(custom_id, msg))
            await self.source.abandon(msg)
            if give_up:
                self._fail(ExitCode.UNAVAILABLE, f"sink failing for {down_for:.0f}s")
            return False
        delay = min(_SINK_RETRY_MAX_S, _SINK_RETRY_FIRST_S * 2 ** min(attempt - 1, 8))
        delay = random.uniform(delay / 2, delay)
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - now))
        log.debug("sink put failed (attempt %d), again in %.1fs: %s", attempt, delay, exc,
                  extra=_ids(custom_id, msg))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain.immediate.wait(), delay)
        return True

    async def _dead_letter(self, msg: Message, reason: str) -> None:
        await self.source.dead_letter(msg, reason)
        self.summary.dead_lettered += 1
        self.metrics.jobs_dead_lettered.inc()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._last_activity = time.monotonic()
        self._progress.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("job task failed", exc_info=task.exception())

    # ------------------------------------------------------------ events

    def _on_step_error(self, exc: BaseException) -> None:
        self._step_failures += 1
        for entry in self._inflight.values():
            if entry.abort_reason is None:
                entry.abort_reason, entry.error = (
                    AbortReason.ENGINE_ERROR,
                    f"engine step failed: {exc}",
                )
                self._thread.abort(entry.request_id)
        if self._step_failures >= _MAX_STEP_FAILURES:
            log.error("engine failed %d steps in a row: stopping", self._step_failures)
            if self.exit_code == ExitCode.OK:
                self.exit_code = ExitCode.ENGINE
            self.drain.request_immediate(DrainReason.FATAL)

    def _on_revoke(self, msgs: list[Message]) -> None:
        revoked = {msg.message_id for msg in msgs}
        kept = [item for item in self._ready if item.msg.message_id not in revoked]
        if len(kept) != len(self._ready):
            self._ready = deque(kept)
        for msg in msgs:
            rid = self._by_message.get(msg.message_id)
            entry = self._inflight.get(rid) if rid else None
            if entry is not None and entry.abort_reason is None:
                entry.abort_reason = AbortReason.REVOKED
                self._thread.abort(rid)

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
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for entry in list(self._inflight.values()):
                deadline = entry.job.deadline
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
                stats.kv_cache_usage_perc, dt, saturated=bool(self._ready)
            )
        self.summary.prompt_tokens = stats.prompt_tokens
        self.summary.generation_tokens = stats.generation_tokens
        self.summary.num_preemptions = stats.num_preemptions

    # ------------------------------------------------------------ drain

    async def _drain(self) -> None:
        self.metrics.draining.set(1)
        self.metrics.ready = False
        reason = self.drain.reason
        self._drain_deadline = time.monotonic() + self.settings.drain_seconds
        # Jobs still at the gate never started: hand them back first, for other workers.
        while self._ready:
            self.summary.abandoned += 1
            await self.source.abandon(self._ready.popleft().msg)
        if self._inflight and not self.drain.immediate.is_set():
            log.info(
                "draining: %d jobs in flight, up to %.0fs",
                len(self._inflight),
                self.settings.drain_seconds,
            )
            until = time.monotonic() + self.settings.drain_seconds
            while self._inflight and time.monotonic() < until and not self.drain.immediate.is_set():
                await self._wait_progress(0.1)
        for entry in self._inflight.values():
            if entry.abort_reason is None:
                entry.abort_reason = AbortReason.DRAIN
                self._thread.abort(entry.request_id)
        until = time.monotonic() + (1.0 if self.drain.immediate.is_set() else _ABORT_WAIT_S)
        while self._inflight and time.monotonic() < until:
            await self._wait_progress(0.05)
        for entry in list(self._inflight.values()):
            self.summary.abandoned += 1
            await self.source.abandon(entry.msg)
        self._inflight.clear()
        self.admission.final_sum = 0
        if self._tasks:
            budget = 2.0 if self.drain.immediate.is_set() else _STORE_WAIT_S
            _, pending = await asyncio.wait(set(self._tasks), timeout=budget)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        log.info("drained (%s)", reason.value if reason else "done")
