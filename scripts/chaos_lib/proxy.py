"""The S3 fault proxy of the campaign: the worker team's ``FaultProxy`` and its fault tally.

Besides 5xx answers, resets before forwarding and latency, the campaign needs the
nastiest storage fault: the PUT reaches S3 and is stored, but the connection dies
before the answer arrives, so the worker retries a write that already happened and
must take the resulting 412 as "already written". ``FaultProxy`` provides that
(``lost_ack_rate``) and counts upstream answers by status (412s included); this
module only names the tallies the campaign reports.
"""

from __future__ import annotations

from qworker.testing.faultproxy import FaultProxy


class ChaosProxy(FaultProxy):
    """``FaultProxy`` plus ``faults``, the campaign's tally; uses its public API only."""

    @property
    def faults(self) -> dict[str, int]:
        """Injected faults by kind, and the 412s S3 answered."""
        s = self.stats
        return {"s3_500": s["errors_500"], "s3_503": s["errors_503"],
                "s3_resets": s["resets"], "s3_lost_acks": self.lost_acks,
                "s3_delayed": s["delayed"], "s3_requests": s["requests"],
                "s3_412": self.status_counts.get(412, 0)}
