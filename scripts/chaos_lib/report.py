"""The campaign's figures: a ``Report`` printed as a table and as one JSON line."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class Report:
    """The campaign's figures; ``ok`` when nothing is missing, duplicated or invalid."""

    queue: str
    seed: int
    jobs_produced: int = 0
    poison_produced: int = 0
    results_found: int = 0
    missing: int = 0
    duplicates: int = 0
    invalid: int = 0
    unexpected: int = 0
    error_records: int = 0
    duplicates_absorbed_412: int = 0
    duplicates_reported_by_workers: int = 0
    dead_lettered: int = 0
    poison_in_dlq: int = 0
    valid_jobs_in_dlq: int = 0
    kills: int = 0
    drains: int = 0
    double_terms: int = 0
    drain_bad_exits: int = 0
    drain_max_seconds: float = 0.0
    drain_seconds: list[float] = field(default_factory=list)
    broker_restarts: int = 0
    s3_outages: int = 0
    worker_starts: int = 0
    worker_crashes: int = 0
    idle_exits: int = 0
    redeliveries: int = 0
    final_lag: int | None = None
    collect_mismatches: int = 0
    conflicts_produced: int = 0
    conflict_records: int = 0
    silently_replaced: int = 0
    bad_conflicts: int = 0
    engine_poison_jobs: int = 0
    hangs: int = 0
    idle_restarts: int = 0
    source_outages: int = 0
    idle_exits_with_work_left: int = 0
    hostile_produced: int = 0
    hostile_jobs: int = 0                # with a custom_id: one record each, checked above
    hostile_dead_expected: int = 0       # no job at all: must be dead-lettered
    hostile_dead_missing: int = 0
    sink_dead_letters: int = 0           # written to the sink's _dead_letters/
    exit_codes: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    wall_seconds: float = 0.0
    samples: dict[str, list[str]] = field(default_factory=dict)
    log_dir: str = ""

    @property
    def ok(self) -> bool:
        """True when every job has exactly one valid result and drains exited 0."""
        return (self.missing == 0 and self.duplicates == 0 and self.invalid == 0
                and self.unexpected == 0 and self.drain_bad_exits == 0
                and self.poison_in_dlq >= self.poison_produced
                and self.collect_mismatches == 0 and self.silently_replaced == 0
                and self.bad_conflicts == 0 and self.worker_crashes == 0
                and self.idle_exits_with_work_left == 0 and self.hostile_dead_missing == 0)

    def as_json(self) -> str:
        """One JSON line with every figure."""
        return json.dumps({**asdict(self), "ok": self.ok}, ensure_ascii=False, sort_keys=True)

    def table(self) -> str:
        """A human table of the figures."""
        rows = [("queue", self.queue), ("seed", self.seed),
                ("jobs produced", self.jobs_produced), ("poison produced", self.poison_produced),
                ("results found", self.results_found), ("MISSING", self.missing),
                ("DUPLICATE objects", self.duplicates), ("INVALID records", self.invalid),
                ("unexpected objects", self.unexpected), ("error records (expected)",
                                                           self.error_records),
                ("412 duplicates absorbed (S3)", self.duplicates_absorbed_412),
                ("duplicates seen by workers", self.duplicates_reported_by_workers),
                ("dead-lettered (DLQ entries)", self.dead_lettered),
                ("poison in DLQ", self.poison_in_dlq),
                ("valid jobs in DLQ", self.valid_jobs_in_dlq),
                ("kills (SIGKILL)", self.kills), ("drains (SIGTERM)", self.drains),
                ("drains cut by a 2nd SIGTERM", self.double_terms),
                ("drains not exiting 0/75", self.drain_bad_exits),
                ("longest drain (s)", f"{self.drain_max_seconds:.1f}"),
                ("broker restarts", self.broker_restarts), ("S3 outages", self.s3_outages),
                ("worker starts", self.worker_starts),
                ("worker crashes", self.worker_crashes), ("idle exits", self.idle_exits),
                ("redeliveries (>=)", self.redeliveries), ("final consumer lag", self.final_lag),
                ("qworker collect mismatches", self.collect_mismatches),
                ("conflicting requests produced", self.conflicts_produced),
                ("conflict records", self.conflict_records),
                ("SILENTLY REPLACED", self.silently_replaced),
                ("conflict records not expected", self.bad_conflicts),
                ("engine-poison jobs (engine_error)", self.engine_poison_jobs),
                ("hung engines (exit 70)", self.hangs),
                ("idle restarts (--until-idle 1)", self.idle_restarts),
                ("source outages", self.source_outages),
                ("IDLE EXITS WITH WORK LEFT", self.idle_exits_with_work_left),
                ("hostile messages produced", self.hostile_produced),
                ("  with a custom_id (one record each)", self.hostile_jobs),
                ("  no job (to be dead-lettered)", self.hostile_dead_expected),
                ("HOSTILE NOT DEAD-LETTERED", self.hostile_dead_missing),
                ("dead letters in the sink", self.sink_dead_letters),
                ("exit codes (fate:rc)", " ".join(f"{k}={v}"
                                                  for k, v in self.exit_codes.items()))]
        rows += [(f"fault {k}", v) for k, v in sorted(self.faults.items())]
        rows += [("wall time (s)", f"{self.wall_seconds:.1f}"), ("RESULT", "OK" if self.ok
                                                                 else "FAILED")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
