"""The S3 fault proxy of the campaign: the worker team's ``FaultProxy`` plus lost acks.

On top of 5xx answers, resets before forwarding and latency, the campaign needs the
nastiest storage fault: the PUT reaches S3 and is stored, but the connection dies
before the answer arrives, so the worker retries a write that already happened and
must take the resulting 412 as "already written". ``ChaosProxy`` adds that
(``lost_ack_rate``) and counts the upstream answers by status (412s included).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from qworker.testing.faultproxy import FaultProxy


class _LostAck(Exception):
    """Raised inside the handler to abandon a request whose answer we dropped."""


class ChaosProxy(FaultProxy):
    """``FaultProxy`` with ``lost_ack_rate`` on successful PUTs and per-status counters.

    Relies on two internals of FaultProxy (its server's handler class and the
    handler's ``_reset``); ``status_counts`` holds the upstream status of every
    forwarded request, ``lost_acks`` the answers dropped after a successful write.
    """

    def __init__(self, upstream: str, *, lost_ack_rate: float = 0.0, **kw: Any) -> None:
        super().__init__(upstream, **kw)
        self.lost_ack_rate = lost_ack_rate
        self.status_counts: Counter[int] = Counter()
        self.lost_acks = 0
        self._extra_lock = threading.Lock()
        proxy = self
        server = self._server
        base = server.RequestHandlerClass

        class Handler(base):  # type: ignore[misc, valid-type]
            injecting = False

            def _error(self, status: int) -> None:
                self.injecting = True
                try:
                    super()._error(status)
                finally:
                    self.injecting = False

            def send_response_only(self, code: int, message: str | None = None) -> None:
                if not self.injecting and proxy._lose_ack(self.command, code):
                    self._reset()
                    raise _LostAck
                super().send_response_only(code, message)

        server.RequestHandlerClass = Handler
        plain_handle_error = server.handle_error

        def handle_error(request: Any, client_address: Any) -> None:
            import sys

            if not isinstance(sys.exc_info()[1], _LostAck | ConnectionError):
                plain_handle_error(request, client_address)

        server.handle_error = handle_error  # type: ignore[method-assign]

    def _lose_ack(self, method: str, status: int) -> bool:
        with self._extra_lock:
            self.status_counts[status] += 1
            if method == "PUT" and status == 200 and self.lost_ack_rate > 0 \
                    and self._rng.random() < self.lost_ack_rate:
                self.lost_acks += 1
                return True
        return False

    @property
    def faults(self) -> dict[str, int]:
        """Injected faults by kind, and the 412s S3 answered."""
        s = self.stats
        with self._extra_lock:
            return {"s3_500": s["errors_500"], "s3_503": s["errors_503"],
                    "s3_resets": s["resets"], "s3_lost_acks": self.lost_acks,
                    "s3_delayed": s["delayed"], "s3_requests": s["requests"],
                    "s3_412": self.status_counts.get(412, 0)}
