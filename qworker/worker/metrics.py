"""Prometheus metrics with DESIGN.md's names, plus ``/healthz`` and ``/readyz``.

Engine gauges and counters follow ``engine.stats()`` (counters advance by the delta
since the last snapshot); the latency histograms come from each finished request's
``RequestOutput.metrics``. One ``WorkerMetrics`` owns its own registry, so several
can coexist in one process (tests).
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from qworker.engine.outputs import RequestOutput
from qworker.engine.stats import EngineStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_COUNTER_STATS = {
    "num_preemptions": "preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "prefix_cache_hits": "prefix_cache_hits",
}


class WorkerMetrics:
    """Every metric of DESIGN.md in one registry; ``ready`` drives ``/readyz``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_running = Gauge(
            "qworker_num_requests_running", "Requests running", registry=r
        )
        self.requests_waiting = Gauge(
            "qworker_num_requests_waiting", "Requests waiting", registry=r
        )
        self.kv_usage = Gauge("qworker_kv_cache_usage_perc", "KV pool usage, 0..1", registry=r)
        self.preemptions = Counter("qworker_num_preemptions", "Preemptions", registry=r)
        self.prompt_tokens = Counter("qworker_prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "qworker_generation_tokens", "Generated tokens", registry=r
        )
        self.prefix_cache_hits = Counter(
            "qworker_prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "qworker_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "qworker_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
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
        self._last: dict[str, float] = {}
        self._server: ThreadingHTTPServer | None = None

    def update_engine(self, stats: EngineStats) -> None:
        """Set gauges and advance counters from one ``engine.stats()`` snapshot."""
        self.requests_running.set(stats.num_requests_running)
        self.requests_waiting.set(stats.num_requests_waiting)
        self.kv_usage.set(stats.kv_cache_usage_perc)
        for key, attr in _COUNTER_STATS.items():
            value = float(getattr(stats, key))
            delta = value - self._last.get(key, 0.0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last[key] = value

    def observe_output(self, output: RequestOutput) -> None:
        """Record a finished request's TTFT and end-to-end latency."""
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

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
                    self._send(200, b"ok\n", "text/plain")
                elif path == "/readyz":
                    ok = metrics.ready
                    self._send(
                        200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain"
                    )
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
