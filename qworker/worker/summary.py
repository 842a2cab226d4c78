"""What one worker run did, for the end-of-run summary and the benchmark."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from qworker.engine.stats import EngineStats


@dataclass(slots=True)
class RunSummary:
    """Counts and rates of one ``Worker.run``; ``kv_usage_*`` sampled while busy."""

    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    received: int = 0
    completed: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    conflicts: int = 0
    step_failures: int = 0
    dead_lettered: int = 0
    #: Dead letters written to the sink's ``_dead_letters/`` (no target, or it refused).
    dead_lettered_to_sink: int = 0
    abandoned: int = 0
    revoked: int = 0
    #: How many jobs ended with each fate (``qworker.worker.job.Fate`` values).
    fates: Counter[str] = field(default_factory=Counter)
    #: Exceptions on one job's path that the supervisor turned into that job's fate.
    job_failures: int = 0
    #: Source calls (ack / abandon) that failed: the message is delivered again.
    source_call_errors: int = 0
    #: A bug guard: settles refused because the job was already settled (always 0).
    settled_twice: int = 0
    sink_failures: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    requests_served: int = 0
    kv_usage_sum: float = 0.0
    kv_usage_time: float = 0.0
    kv_usage_peak: float = 0.0
    kv_saturated_sum: float = 0.0
    kv_saturated_time: float = 0.0
    drain_reason: str | None = None

    def sample_kv(self, usage: float, dt: float, saturated: bool = False) -> None:
        """Add ``dt`` seconds at pool usage ``usage`` (0..1) to the time averages.

        ``saturated``: jobs were waiting at the admission gate (the pool was the limit).
        """
        self.kv_usage_sum += usage * dt
        self.kv_usage_time += dt
        self.kv_usage_peak = max(self.kv_usage_peak, usage)
        if saturated:
            self.kv_saturated_sum += usage * dt
            self.kv_saturated_time += dt

    def observe_engine(self, stats: EngineStats, dt: float, saturated: bool = False) -> None:
        """Take one ``engine.stats()`` snapshot, ``dt`` seconds after the previous one."""
        if stats.num_requests_running or stats.num_requests_waiting:
            self.sample_kv(stats.kv_cache_usage_perc, dt, saturated=saturated)
        self.prompt_tokens = stats.prompt_tokens
        self.generation_tokens = stats.generation_tokens
        self.num_preemptions = stats.num_preemptions

    @property
    def settled(self) -> int:
        """Jobs settled so far, any fate (equals ``received`` once a run has drained)."""
        return sum(self.fates.values())

    @property
    def elapsed(self) -> float:
        """Seconds from start to finish (or now)."""
        return (self.finished or time.monotonic()) - self.started

    @property
    def kv_usage_mean(self) -> float:
        """Time-averaged KV pool usage while requests were in the engine (0..1)."""
        return self.kv_usage_sum / self.kv_usage_time if self.kv_usage_time else 0.0

    @property
    def kv_usage_saturated(self) -> float | None:
        """Time-averaged usage while jobs waited for pool space; None if they never did."""
        if not self.kv_saturated_time:
            return None
        return self.kv_saturated_sum / self.kv_saturated_time

    def text(self) -> str:
        """A few human lines for stderr."""
        done = sum(self.completed.values())
        secs = max(self.elapsed, 1e-9)
        statuses = ", ".join(f"{k}={v}" for k, v in sorted(self.completed.items())) or "none"
        to_sink = f" ({self.dead_lettered_to_sink} to the sink)" if self.dead_lettered_to_sink \
            else ""
        return (
            f"jobs: received {self.received}, completed {done} ({statuses}), "
            f"duplicates {self.duplicates}, conflicts {self.conflicts}, "
            f"dead-lettered {self.dead_lettered}{to_sink}, abandoned {self.abandoned}, "
            f"engine step failures {self.step_failures}\n"
            f"tokens: prompt {self.prompt_tokens}, generated {self.generation_tokens} "
            f"in {secs:.1f}s = {self.generation_tokens / secs:.1f} tok/s "
            f"({self.prompt_tokens / secs:.1f} prompt tok/s: an embedding worker's rate), "
            f"{done / secs:.2f} jobs/s\n"
            f"kv cache: mean usage {self.kv_usage_mean:.1%} (peak {self.kv_usage_peak:.1%}), "
            f"preemptions {self.num_preemptions}"
        )

    def as_dict(self) -> dict:
        """JSON-friendly figures."""
        return {
            "received": self.received,
            "completed": dict(self.completed),
            "duplicates": self.duplicates,
            "conflicts": self.conflicts,
            "step_failures": self.step_failures,
            "dead_lettered": self.dead_lettered,
            "dead_lettered_to_sink": self.dead_lettered_to_sink,
            "abandoned": self.abandoned,
            "revoked": self.revoked,
            "fates": dict(self.fates),
            "job_failures": self.job_failures,
            "elapsed_s": round(self.elapsed, 3),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "kv_usage_mean": round(self.kv_usage_mean, 4),
            "kv_usage_peak": round(self.kv_usage_peak, 4),
            "kv_usage_saturated": (
                None if self.kv_usage_saturated is None else round(self.kv_usage_saturated, 4)
            ),
            "num_preemptions": self.num_preemptions,
            "drain_reason": self.drain_reason,
        }
