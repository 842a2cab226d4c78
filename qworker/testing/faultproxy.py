"""A fault-injecting HTTP proxy for S3-like servers (tests and the chaos campaign).

Put it in front of moto (or any HTTP server) and point the client's endpoint at
it. Each request is forwarded unchanged unless a fault is drawn for it:

- ``error_rate``: answer 500 InternalError or 503 SlowDown (S3-style XML) without
  forwarding;
- ``reset_rate``: close the connection abruptly (TCP RST) without answering;
- ``lost_ack_rate``: forward a write (PUT/POST/DELETE) upstream, so it takes
  effect, then reset the client connection instead of answering: the client
  cannot tell whether its write happened (S3: a retried conditional PUT gets 412);
- ``latency``: sleep this many seconds before forwarding (every request).

``fail_next(n)`` makes the next ``n`` requests fail deterministically, for tests
that need "S3 answers 503 for a while". ``fail_methods`` limits the drawn faults to
requests of those HTTP methods (e.g. writes only: reads pass). Rates and latency may be
changed while running (``configure``). Draws come from ``random.Random(seed)``, so a run with
one client thread is reproducible. Standard library only.

Use::

    proxy = FaultProxy("http://127.0.0.1:5000", error_rate=0.2, seed=1)
    url = proxy.start()
    ...
    print(proxy.stats)   # {'requests': ..., 'forwarded': ..., 'errors_500': ..., ...}
    print(proxy.lost_acks, proxy.status_counts)   # 3 {200: 57, 412: 3}
    proxy.stop()

or from a shell: ``python -m qworker.testing.faultproxy --upstream URL --port 0 --error-rate 0.1``.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import random
import socket
import struct
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)

_WRITE_METHODS = frozenset({"PUT", "POST", "DELETE"})

_ERROR_BODIES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (a killed worker, a timeout) is routine here, not a bug.
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("faultproxy: client %s went away", client_address)
            return
        super().handle_error(request, client_address)


class FaultProxy:
    """A threaded forwarding proxy that injects 500/503 answers, resets, lost acks, latency.

    Thread-safe: counters and settings are guarded by one lock. ``stats`` returns a
    snapshot dict with ``requests``, ``forwarded``, ``errors_500``, ``errors_503``,
    ``resets`` and ``delayed``; ``lost_acks`` counts writes forwarded whose answer
    was dropped; ``status_counts`` counts upstream answers by HTTP status.
    """

    def __init__(
        self,
        upstream: str,
        *,
        error_rate: float = 0.0,
        latency: float = 0.0,
        reset_rate: float = 0.0,
        lost_ack_rate: float = 0.0,
        seed: int | None = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        upstream_timeout: float = 30.0,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream {upstream!r} must be http://host:port")
        self.upstream_host = parsed.hostname
        self.upstream_port = parsed.port or 80
        self.upstream_timeout = upstream_timeout
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._fail_next: list[int] = []
        self._counts = dict.fromkeys(
            ("requests", "forwarded", "errors_500", "errors_503", "resets", "delayed"), 0
        )
        self._lost_acks = 0
        self._statuses: dict[int, int] = {}
        self.error_rate = 0.0
        self.latency = 0.0
        self.reset_rate = 0.0
        self.lost_ack_rate = 0.0
        self.fail_methods: frozenset[str] | None = None
        self.configure(
            error_rate=error_rate,
            latency=latency,
            reset_rate=reset_rate,
            lost_ack_rate=lost_ack_rate,
        )
        self._server = _Server((host, port), _make_handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The proxy's base URL (``http://host:port``); valid once constructed."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def configure(
        self,
        *,
        error_rate: float | None = None,
        latency: float | None = None,
        reset_rate: float | None = None,
        lost_ack_rate: float | None = None,
        fail_methods: set[str] | frozenset[str] | None = None,
    ) -> None:
        """Change fault settings while running; None leaves a setting as it is.

        ``fail_methods``: draw faults only for these methods (an empty set: all again).
        """
        for name, value in (
            ("error_rate", error_rate),
            ("reset_rate", reset_rate),
            ("lost_ack_rate", lost_ack_rate),
        ):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if latency is not None and latency < 0:
            raise ValueError(f"latency must be >= 0, got {latency}")
        with self._lock:
            if error_rate is not None:
                self.error_rate = error_rate
            if latency is not None:
                self.latency = latency
            if reset_rate is not None:
                self.reset_rate = reset_rate
            if lost_ack_rate is not None:
                self.lost_ack_rate = lost_ack_rate
            if fail_methods is not None:
                self.fail_methods = frozenset(m.upper() for m in fail_methods) or None

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next ``n`` requests with ``status`` (500 or 503 or 0 for a reset)."""
        if status not in (0, 500, 503):
            raise ValueError(f"status must be 0 (reset), 500 or 503, got {status}")
        with self._lock:
            self._fail_next.extend([status] * n)

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters."""
        with self._lock:
            return dict(self._counts)

    @property
    def lost_acks(self) -> int:
        """Writes forwarded upstream whose answer the client never got (connection reset)."""
        with self._lock:
            return self._lost_acks

    @property
    def status_counts(self) -> dict[int, int]:
        """Upstream answers by HTTP status (lost acks included; injected errors are not)."""
        with self._lock:
            return dict(self._statuses)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _count_answer(self, status: int, lost: bool) -> None:
        with self._lock:
            self._counts["forwarded"] += 1
            self._statuses[status] = self._statuses.get(status, 0) + 1
            if lost:
                self._lost_acks += 1

    def draw(self, method: str = "PUT") -> tuple[str, int, float]:
        """Decide one request's fate: ``("forward"|"error"|"reset"|"lost_ack", status, delay)``.

        Only writes (``method`` PUT, POST or DELETE) can draw a lost ack.
        """
        with self._lock:
            self._counts["requests"] += 1
            delay = self.latency
            if self._fail_next:
                status = self._fail_next.pop(0)
                return ("reset", 0, delay) if status == 0 else ("error", status, delay)
            if self.fail_methods is not None and method.upper() not in self.fail_methods:
                return "forward", 0, delay
            roll = self._rng.random()
            if roll < self.reset_rate:
                return "reset", 0, delay
            if roll < self.reset_rate + self.error_rate:
                return "error", self._rng.choice((500, 503)), delay
            lost_ack = roll < self.reset_rate + self.error_rate + self.lost_ack_rate
            if lost_ack and method.upper() in _WRITE_METHODS:
                return "lost_ack", 0, delay
            return "forward", 0, delay

    def start(self) -> str:
        """Serve on a background thread; return the proxy URL."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, name="faultproxy", daemon=True
            )
            self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and close the listening socket; idempotent."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(
    upstream: str,
    error_rate: float = 0.0,
    latency: float = 0.0,
    reset_rate: float = 0.0,
    seed: int | None = 0,
    port: int = 0,
    lost_ack_rate: float = 0.0,
) -> FaultProxy:
    """Start a ``FaultProxy`` in front of ``upstream``; its ``url`` is the endpoint to use."""
    proxy = FaultProxy(
        upstream,
        error_rate=error_rate,
        latency=latency,
        reset_rate=reset_rate,
        lost_ack_rate=lost_ack_rate,
        seed=seed,
        port=port,
    )
    proxy.start()
    return proxy


def _make_handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("faultproxy: " + format, *args)

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _reset(self) -> None:
            # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def _error(self, status: int) -> None:
            code, message = _ERROR_BODIES[status]
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                "<RequestId>faultproxy</RequestId></Error>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _handle(self) -> None:
            body = self._read_body()
            action, status, delay = proxy.draw(self.command)
            if delay > 0:
                proxy._count("delayed")
                time.sleep(delay)
            if action == "reset":
                proxy._count("resets")
                self._reset()
                return
            if action == "error":
                proxy._count(f"errors_{status}")
                self._error(status)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(
                proxy.upstream_host, proxy.upstream_port, timeout=proxy.upstream_timeout
            )
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except OSError as exc:
                log.warning("faultproxy: upstream failed: %s", exc)
                self._reset()
                return
            finally:
                conn.close()
            proxy._count_answer(resp.status, lost=action == "lost_ack")
            if action == "lost_ack":
                self._reset()  # the write happened upstream; its answer never arrives
                return
            self.send_response_only(resp.status, resp.reason)
            for name, value in resp.getheaders():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Run a proxy in the foreground until interrupted; prints its URL, then stats at exit."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--upstream", required=True, help="http://host:port to forward to")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--reset-rate", type=float, default=0.0)
    parser.add_argument("--lost-ack-rate", type=float, default=0.0)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    proxy = start(
        args.upstream,
        error_rate=args.error_rate,
        latency=args.latency,
        reset_rate=args.reset_rate,
        lost_ack_rate=args.lost_ack_rate,
        seed=args.seed,
        port=args.port,
    )
    print(proxy.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()
        print(proxy.stats, {"lost_acks": proxy.lost_acks}, proxy.status_counts, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
