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
from qworker.worker.sinks import open_sink, sink_prefix
from qworker.worker.sources import open_source
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

    ``/healthz`` answers from the start, ``/readyz`` only once the model is loaded
    and until the drain begins. A signal during model loading stops after the load;
    ``pending_signals`` (SIGTERMs that arrived before this) start the drain at once.
    ``hard_exit``: a signal arms the process's hard exit (``DrainControl.on_signal``)
    and it stays armed for the process's own exit (the CLI); otherwise it is disarmed
    when ``serve`` returns (an embedding process goes on).
    A configuration problem found at start (a missing queue, topic, bucket or model)
    is logged as one line and returned as exit 1 (docs/operations.md).
    """
    loop = asyncio.get_running_loop()
    drain = DrainControl(drain_budget(settings.drain_seconds))
    drain.install(loop)
    for signum in list(pending_signals or ()):
        drain.on_signal(signum)
    metrics = WorkerMetrics(settings.metrics_max_batches)
    summary = RunSummary()
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
            await sink.check()
        except (StartupError, ValueError, OSError) as exc:
            log.error("cannot start: %s", _one_line(exc))
            return ExitCode.CONFIG, summary
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
            try:
                summary = await worker.run()
            except StartupError as exc:
                log.error("cannot start: %s", _one_line(exc))
                return ExitCode.CONFIG, worker.summary
            return worker.exit_code, summary
        finally:
            engine.close()  # tensor-parallel ranks never outlive the worker
    finally:
        drain.uninstall(loop)
        if not hard_exit:
            drain.disarm()
        metrics.close()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."
