"""The fault proxy: forwards faithfully, injects the faults it is told to, counts them."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from qworker.testing.faultproxy import FaultProxy, start


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        data = f"{self.command} {self.path} ".encode() + body
        self.send_response(201)
        self.send_header("X-Upstream", "yes")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = _answer


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _request(url: str, method: str = "PUT", body: bytes = b"hello") -> tuple[int, bytes, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, "/bucket/key?x=1", body=body)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("X-Upstream") or ""
    finally:
        conn.close()


def test_without_faults_requests_and_answers_pass_through_unchanged(upstream: str) -> None:
    proxy = start(upstream)
    try:
        assert _request(proxy.url) == (201, b"PUT /bucket/key?x=1 hello", "yes")
        assert _request(proxy.url, "GET", b"") == (201, b"GET /bucket/key?x=1 ", "yes")
    finally:
        proxy.stop()
    assert proxy.stats["forwarded"] == 2
    assert proxy.stats["requests"] == 2


def test_fail_next_answers_s3_style_errors_then_recovers(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        proxy.fail_next(1, status=503)
        proxy.fail_next(1, status=500)
        status, body, _ = _request(proxy.url)
        assert status == 503 and b"<Code>SlowDown</Code>" in body
        status, body, _ = _request(proxy.url)
        assert status == 500 and b"<Code>InternalError</Code>" in body
        assert _request(proxy.url)[0] == 201
        assert proxy.stats == {
            "requests": 3,
            "forwarded": 1,
            "errors_500": 1,
            "errors_503": 1,
            "resets": 0,
            "delayed": 0,
        }


def test_a_reset_closes_the_connection_without_an_answer(upstream: str) -> None:
    with FaultProxy(upstream) as proxy:
        proxy.fail_next(1, status=0)
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            _request(proxy.url)
        assert proxy.stats["resets"] == 1


class _Store(BaseHTTPRequestHandler):
    """Upstream that stores PUT bodies: 200 the first time a key is written, then 412."""

    protocol_version = "HTTP/1.1"
    stored: ClassVar[dict[str, bytes]] = {}

    def log_message(self, *args: object) -> None:
        pass

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = 412 if self.path in self.stored else 200
        self.stored.setdefault(self.path, body)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_a_lost_ack_stores_the_write_upstream_but_resets_the_client() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}",
                        lost_ack_rate=1.0) as proxy:
            with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
                _request(proxy.url, "PUT", b"result")
            assert _Store.stored == {"/bucket/key?x=1": b"result"}  # the write happened
            proxy.configure(lost_ack_rate=0.0)
            assert _request(proxy.url, "PUT", b"result")[0] == 412  # the retry: a duplicate
            assert proxy.lost_acks == 1
            assert proxy.status_counts == {200: 1, 412: 1}
            assert proxy.stats["forwarded"] == 2 and proxy.stats["resets"] == 0
    finally:
        server.shutdown()
        server.server_close()


def test_lost_acks_are_drawn_for_writes_only(upstream: str) -> None:
    with FaultProxy(upstream, lost_ack_rate=1.0) as proxy:
        assert _request(proxy.url, "GET", b"")[0] == 201
        assert proxy.lost_acks == 0 and proxy.status_counts == {201: 1}
        assert proxy.draw("GET")[0] == "forward" and proxy.draw("PUT")[0] == "lost_ack"


def test_the_same_seed_draws_the_same_faults() -> None:
    def draws(seed: int) -> list[tuple[str, int, float]]:
        proxy = FaultProxy("http://127.0.0.1:9", error_rate=0.3, reset_rate=0.2, seed=seed)
        try:
            return [proxy.draw() for _ in range(200)]
        finally:
            proxy.stop()

    first = draws(7)
    assert first == draws(7)
    kinds = [kind for kind, _, _ in first]
    assert {"forward", "error", "reset"} <= set(kinds)
    assert 0.3 < kinds.count("forward") / len(kinds) < 0.7


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        FaultProxy("http://127.0.0.1:9", error_rate=1.5)
    with pytest.raises(ValueError, match="lost_ack_rate"):
        FaultProxy("http://127.0.0.1:9", lost_ack_rate=-0.1)
    with pytest.raises(ValueError, match="upstream"):
        FaultProxy("ftp://x")
