"""Assembles a worker from settings: metrics server, signals, engine, source, sink.

This is the one place that turns ``WorkerSettings`` into running objects; the CLI
calls ``serve`` and the tests may too.
"""

from __future__ import annotations

import asyncio
import logging

from qworker.config import WorkerSettings
from qworker.errors import ModelLoadError
from qworker.worker.drain import DrainControl, drain_budget
from qworker.worker.engine_thread import EngineLike
from qworker.worker.exit_codes import ExitCode
from qworker.worker.failures import StartupError
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.outage import Backoff, Outage
from qworker.worker.retry import Retrier
from qworker.worker.sinks import Sink, open_sink, sink_prefix
from qworker.worker.source_start import Started, start_source
from qworker.worker.sources import Source, open_source
from qworker.worker.summary import RunSummary
from qworker.worker.worker import Worker

log = logging.getLogger(__name__)


def build_engine(settings: WorkerSettings) -> EngineLike:
    """The echo engine for ``echo://`` models, else the real engine for the settings' task
    (``open_engine``: ``Engine`` or ``EmbeddingEngine``; loads weights)."""
    if settings.is_echo:
        from qworker.worker.echo_engine import EchoEngine

        echo = EchoEngine.from_uri(settings.model)
        if settings.served_model_name:
            echo.model_name = settings.served_model_name
        return echo
    from qworker.engine import open_engine

    return open_engine(settings.engine_config())


async def serve(settings: WorkerSettings, pending_signals: list[int] | None = None,
                hard_exit: bool = False) -> tuple[int, RunSummary]:
    """Run one worker until it drains; return (exit code, summary).

    Order (docs/operations.md, "Startup checks"): the source, its dead-letter target and
    the sink are checked first, so a missing queue, topic, file or bucket or refused
    credentials end the run in seconds (exit 1, one line), before the model loads
    (minutes for a large one). Only then does the engine load and the source start
    (join its group, begin polling). ``/healthz`` answers from the start, ``/readyz``
    only once the model is loaded and until the drain begins. A signal during the
    checks ends the run at once (exit 75), one during model loading after the load;
    ``pending_signals`` (SIGTERMs that arrived before this) do so before any check.
    ``hard_exit``: a signal arms the process's hard exit (``DrainControl.on_signal``)
    and it stays armed for the process's own exit (the CLI); otherwise it is disarmed
    when ``serve`` returns (an embedding process goes on). The source and the sink are
    closed on every path (the worker closes them once it runs).
    """
    loop = asyncio.get_running_loop()
    drain = DrainControl(drain_budget(settings.drain_seconds))
    drain.install(loop)
    for signum in list(pending_signals or ()):
        drain.on_signal(signum)
    metrics = WorkerMetrics(settings.metrics_max_batches)
    summary = RunSummary()
    source: Source | None = None
    sink: Sink | None = None
    try:
        try:
            port = metrics.serve(settings.metrics_port)
            log.info("metrics on http://0.0.0.0:%d/metrics (also /healthz, /readyz)", port)
        except OSError as exc:
            log.warning(
                "metrics port %d unavailable (%s): serving no metrics", settings.metrics_port, exc
            )
        try:
            source = open_source(settings.source, settings)
            sink = open_sink(settings.sink, settings)
            checked = await _check_source(settings, source, drain, metrics)
            if checked is Started.STARTED:
                await sink.check()
        except (StartupError, ValueError, OSError) as exc:
            log.error("cannot start: %s", _one_line(exc))
            return ExitCode.CONFIG, summary
        if checked is Started.DRAINED:
            log.warning("stop requested during the startup checks: exiting before serving")
            return ExitCode.DRAINED, summary
        if checked is Started.UNREACHABLE:
            return ExitCode.UNAVAILABLE, summary
        log.info("loading model %s", settings.model)
        try:
            engine = await asyncio.to_thread(build_engine, settings)
        except Exception as exc:  # any load failure is one line, never a traceback
            what = "" if isinstance(exc, ModelLoadError | ValueError) else f"{type(exc).__name__}: "
            log.error("cannot load model %s: %s%s", settings.model, what, _one_line(exc))
            return ExitCode.CONFIG, summary
        try:
            stats = engine.stats()
            log.info(
                "engine ready: model %s, %d KV blocks of %d tokens, max_model_len %d",
                engine.model_name,
                stats.num_kv_blocks,
                stats.block_size,
                engine.max_model_len,
            )
            worker = Worker(settings, engine, source, sink, sink_prefix(settings.sink), metrics,
                            drain)
            if drain.draining.is_set():
                log.warning("stop requested while loading: exiting before serving")
                return ExitCode.DRAINED, worker.summary
            log.info("serving jobs from %s into %s", settings.source, settings.sink)
            source = sink = None  # from here on the worker closes them, whatever happens
            try:
                summary = await worker.run()
            except StartupError as exc:
                log.error("cannot start: %s", _one_line(exc))
                return ExitCode.CONFIG, worker.summary
            return worker.exit_code, summary
        finally:
            engine.close()  # tensor-parallel ranks never outlive the worker
    finally:
        await _close_unserved(source, sink, drain.budget.close)
        drain.uninstall(loop)
        if not hard_exit:
            drain.disarm()
        metrics.close()


async def _check_source(settings: WorkerSettings, source: Source, drain: DrainControl,
                        metrics: WorkerMetrics) -> Started:
    """``source.check()`` raced against a drain and retried within the source's outage
    budget (an unreachable server at start is an outage: exit 69 once it is spent)."""
    retrier = Retrier(Outage("source", settings.source_outage_seconds, metrics.set_problem),
                      Backoff(first=0.2, cap=5.0), wake=drain.draining)
    return await start_source(source, drain, retrier, drain.budget.close, check_only=True)


async def _close_unserved(source: Source | None, sink: Sink | None, budget: float) -> None:
    """Close what was opened but never handed to a running worker (no client left behind
    to warn "Unclosed ..." at exit); never raises."""
    for what, closing in (("source", source), ("sink", sink)):
        if closing is None:
            continue
        try:
            await asyncio.wait_for(closing.close(), max(0.5, budget))
        except Exception as exc:
            log.warning("closing the %s failed: %r", what, exc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."
