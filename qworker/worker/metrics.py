"""Prometheus metrics (docs/formats.md, "Metrics"), plus ``/healthz`` and ``/readyz``.

``/readyz`` answers 200 while ``ready`` (model loaded, not draining) and no health
problem is active; ``/healthz`` 200 while no problem is active. Problems are named
conditions the worker sets while they hold (``source``, ``sink``, ``dead_letter``
failing; ``engine`` hung or dead), the states that end in exit 69 or 70
(docs/operations.md, "Health").

Engine gauges and counters follow ``engine.stats()`` (counters advance by the delta
since the last snapshot) and carry a ``model_name`` label (the served name), as vLLM's
do; the latency histograms (time to first token, end to end, queue time, inter-token
latency) come from each finished request's ``RequestOutput.metrics``. ``qworker_info``
carries the version and model; ``qworker_kernel_path`` (one series per engine component
and the implementation serving it) and ``qworker_kernel_selftest`` (the start-up kernel
self-test's outcome) say which kernels actually run. Per-batch completion counters keep
series for the ``max_batches`` batches completed most recently (least recently used dropped), so a
worker that serves a million batches still exports a bounded number of series. One
``WorkerMetrics`` owns its own registry, so several can coexist in one process (tests).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from qworker import __version__
from qworker.engine.outputs import RequestOutput
from qworker.engine.stats import EngineStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
# vLLM's inter-token latency buckets (seconds).
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_COUNTER_STATS = {
    "num_preemptions": "preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "prefix_cache_hits": "prefix_cache_hits",
    "prefix_cache_queries": "prefix_cache_queries",
}
_ENGINE_METRICS = ("requests_running", "requests_waiting", "kv_usage", "preemptions",
                   "prompt_tokens", "generation_tokens", "prefix_cache_hits",
                   "prefix_cache_queries", "ttft", "e2e", "queue_time", "itl")
#: Batches with their own ``qworker_batch_jobs_completed_total`` series, at most.
DEFAULT_MAX_BATCHES = 64


class WorkerMetrics:
    """Every metric of docs/formats.md in one registry; ``ready`` drives ``/readyz``.

    Engine metrics have no series until ``set_model`` names the served model (the
    ``Worker`` calls it with ``engine.model_name``).
    """

    def __init__(self, max_batches: int = DEFAULT_MAX_BATCHES) -> None:
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self._families: dict[str, Any] = {
            "requests_running": Gauge("qworker_num_requests_running", "Requests running", m,
                                      registry=r),
            "requests_waiting": Gauge("qworker_num_requests_waiting", "Requests waiting", m,
                                      registry=r),
            "kv_usage": Gauge("qworker_kv_cache_usage_perc", "KV pool usage, 0..1", m,
                              registry=r),
            "preemptions": Counter("qworker_num_preemptions", "Preemptions", m, registry=r),
            "prompt_tokens": Counter("qworker_prompt_tokens", "Prefilled prompt tokens", m,
                                     registry=r),
            "generation_tokens": Counter("qworker_generation_tokens", "Generated tokens", m,
                                         registry=r),
            "prefix_cache_hits": Counter(
                "qworker_prefix_cache_hits", "Prompt tokens served from the prefix cache", m,
                registry=r),
            "prefix_cache_queries": Counter(
                "qworker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m,
                registry=r),
            "ttft": Histogram("qworker_time_to_first_token_seconds", "Arrival to first token",
                              m, buckets=_LATENCY_BUCKETS, registry=r),
            "e2e": Histogram("qworker_e2e_request_latency_seconds", "Arrival to finish", m,
                             buckets=_LATENCY_BUCKETS, registry=r),
            "queue_time": Histogram(
                "qworker_request_queue_time_seconds", "Arrival to first scheduled step", m,
                buckets=_LATENCY_BUCKETS, registry=r),
            "itl": Histogram(
                "qworker_inter_token_latency_seconds",
                "Mean time between two output tokens, one observation per request", m,
                buckets=_ITL_BUCKETS, registry=r),
        }
        self.kernel_path = Gauge(
            "qworker_kernel_path",
            "1 for each engine component (decode, prefill, cache_write, fused ops) and the "
            "implementation serving it (tensor_core, legacy, sdpa, cuda, torch, cpu)",
            ["model_name", "component", "path"], registry=r)
        self.kernel_selftest = Gauge(
            "qworker_kernel_selftest",
            "1 for the outcome of the kernel self-test at engine start (passed, fell_back, "
            "off, not_applicable)", ["model_name", "state"], registry=r)
        self._kernel_state: tuple[Any, ...] | None = None
        self.info = Info("qworker", "qworker version and served model", registry=r)
        self.info.info({"version": __version__, "model_name": ""})
        self.model_name: str | None = None
        self.batch_jobs_completed = Counter(
            "qworker_batch_jobs_completed",
            "Jobs whose record was written, per batch (the most recent batches only) and status",
            ["batch_id", "status"], registry=r)
        self.max_batches = max(1, max_batches)
        self._batches: OrderedDict[str, set[str]] = OrderedDict()
        self._batch_lock = threading.Lock()
        self.jobs_received = Counter("qworker_jobs_received", "Job messages received", registry=r)
        self.jobs_completed = Counter(
            "qworker_jobs_completed",
            "Jobs whose record was written, by status",
            ["status"],
            registry=r,
        )
        self.jobs_duplicate = Counter(
            "qworker_jobs_duplicate", "Results already present in the sink", registry=r
        )
        self.jobs_conflict = Counter(
            "qworker_jobs_conflict",
            "Jobs whose custom_id already held another request's result (duplicate_custom_id)",
            registry=r,
        )
        self.jobs_dead_lettered = Counter(
            "qworker_jobs_dead_lettered", "Messages sent to the dead-letter target", registry=r
        )
        self.inflight = Gauge("qworker_inflight_jobs", "Jobs inside the worker", registry=r)
        self.uncommitted = Gauge(
            "qworker_uncommitted_offsets", "Received messages not yet committed", registry=r
        )
        self.sink_put_seconds = Histogram(
            "qworker_sink_put_seconds", "Sink put latency", registry=r
        )
        self.sink_retries = Counter("qworker_sink_retries", "Sink put retries", registry=r)
        self.draining = Gauge("qworker_draining", "1 while draining", registry=r)
        self.spot_interruptions = Counter(
            "qworker_spot_interruptions", "Spot interruption notices seen", registry=r
        )
        self.ready = False
        self._problems: set[str] = set()
        self._problem_lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._server: ThreadingHTTPServer | None = None

    def set_problem(self, name: str, active: bool) -> None:
        """Mark the health problem ``name`` active or over (any thread)."""
        with self._problem_lock:
            if active:
                self._problems.add(name)
            else:
                self._problems.discard(name)

    @property
    def problems(self) -> list[str]:
        """The active health problems, sorted."""
        with self._problem_lock:
            return sorted(self._problems)

    @property
    def healthy(self) -> bool:
        """True while no health problem is active."""
        return not self.problems

    def set_model(self, model_name: str) -> None:
        """Name the served model: engine series get ``model_name``, ``qworker_info`` too."""
        if model_name == self.model_name:
            return
        self.model_name = model_name
        for attr in _ENGINE_METRICS:
            setattr(self, attr, self._families[attr].labels(model_name=model_name))
        self.info.info({"version": __version__, "model_name": model_name})

    def __getattr__(self, name: str) -> Any:
        # Engine metrics before set_model: series for an unnamed model.
        if name in _ENGINE_METRICS:
            self.set_model("unknown")
            return getattr(self, name)
        raise AttributeError(name)

    def update_engine(self, stats: EngineStats) -> None:
        """Set gauges and advance counters from one ``engine.stats()`` snapshot."""
        self.requests_running.set(stats.num_requests_running)
        self.requests_waiting.set(stats.num_requests_waiting)
        self.kv_usage.set(stats.kv_cache_usage_perc)
        self._update_kernels(stats)
        for key, attr in _COUNTER_STATS.items():
            value = float(getattr(stats, key, 0) or 0)
            delta = value - self._last.get(key, 0.0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last[key] = value

    def _update_kernels(self, stats: EngineStats) -> None:
        """Series of ``qworker_kernel_path`` / ``_selftest`` (rewritten only on a change)."""
        state = (self.model_name, stats.kernel_selftest, tuple(sorted(stats.kernel_paths.items())))
        if state == self._kernel_state:
            return
        self._kernel_state = state
        self.kernel_path.clear()
        self.kernel_selftest.clear()
        model = self.model_name or "unknown"
        for component, path in stats.kernel_paths.items():
            self.kernel_path.labels(model_name=model, component=component, path=path).set(1)
        self.kernel_selftest.labels(model_name=model, state=stats.kernel_selftest).set(1)

    def observe_output(self, output: RequestOutput) -> None:
        """Record a finished request's TTFT, end-to-end, queue and inter-token latency."""
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        if m.first_token_time is not None and m.finished_time is not None and tokens > 1:
            self.itl.observe(max(0.0, m.finished_time - m.first_token_time) / (tokens - 1))

    def job_completed(self, status: str, batch_id: str | None) -> None:
        """Count a stored record: ``qworker_jobs_completed_total`` and the batch's counter."""
        self.jobs_completed.labels(status=status).inc()
        batch = batch_id or "default"
        with self._batch_lock:
            statuses = self._batches.pop(batch, set())
            self._batches[batch] = statuses  # most recent last
            if status not in statuses:
                statuses.add(status)
            while len(self._batches) > self.max_batches:
                old, old_statuses = self._batches.popitem(last=False)
                for old_status in old_statuses:
                    self.batch_jobs_completed.remove(old, old_status)
            self.batch_jobs_completed.labels(batch_id=batch, status=status).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics``, ``/healthz``, ``/readyz`` on a daemon thread; return the port."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    problems = metrics.problems
                    body = ("failing: " + ", ".join(problems) if problems else "ok") + "\n"
                    self._send(503 if problems else 200, body.encode(), "text/plain")
                elif path == "/readyz":
                    problems = metrics.problems
                    ok = metrics.ready and not problems
                    body = "ready" if ok else ("failing: " + ", ".join(problems)
                                               if problems else "not ready")
                    self._send(200 if ok else 503, (body + "\n").encode(), "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        thread = threading.Thread(
            target=self._server.serve_forever, name="qworker-metrics", daemon=True
        )
        thread.start()
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop the HTTP server if one runs."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
