"""The fault campaign: many jobs through 2-3 workers while everything around them fails.

Starts moto (S3 + SQS) and the tansu broker (its storage on moto's S3, so topics
and committed offsets survive a broker restart), puts a fault-injecting proxy
between the workers and S3, produces N jobs (plus poison messages) with
``qworker produce``, runs ``qworker run --model echo://`` workers in one consumer
group, and while they work SIGKILLs and restarts some, SIGTERMs (drains) others and
restarts the broker. Then it checks the sink: every job exactly one valid result.

    .venv/bin/python scripts/chaos.py --jobs 2000 --workers 3 --kafka
    .venv/bin/python scripts/chaos.py --jobs 2000 --workers 3 --sqs --json
    .venv/bin/python scripts/chaos.py --file --jobs 300 --hostile 60 --kills 1 --drains 1
    .venv/bin/python scripts/chaos.py --sqs --jobs 300 --hostile 60 --refusing-dlq

Prints a table and one JSON line; exits 1 when anything is missing, duplicated,
invalid or silently replaced, or a worker's exit code is not what the contract says
(docs/operations.md), 0 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chaos_lib.campaign import CampaignConfig, run_campaign


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    d = CampaignConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    q = p.add_mutually_exclusive_group()
    q.add_argument("--kafka", dest="queue", action="store_const", const="kafka")
    q.add_argument("--sqs", dest="queue", action="store_const", const="sqs")
    q.add_argument("--file", dest="queue", action="store_const", const="file",
                   help="the embedded file:// spool (one worker)")
    p.set_defaults(queue="kafka")
    p.add_argument("--jobs", type=int, default=d.jobs)
    p.add_argument("--workers", type=int, default=d.workers, choices=(1, 2, 3, 4))
    p.add_argument("--duration", type=float, default=d.duration,
                   help="give up after this many seconds (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--s3-error-rate", type=float, default=d.s3_error_rate)
    p.add_argument("--s3-latency", type=float, default=d.s3_latency, help="seconds per request")
    p.add_argument("--reset-rate", type=float, default=d.reset_rate)
    p.add_argument("--lost-ack-rate", type=float, default=d.lost_ack_rate,
                   help="share of successful PUTs whose answer is dropped")
    p.add_argument("--kills", type=int, default=d.kills)
    p.add_argument("--drains", type=int, default=d.drains)
    p.add_argument("--broker-restarts", type=int, default=d.broker_restarts)
    p.add_argument("--double-terms", type=int, default=d.double_terms,
                   help="SIGTERM a worker, then SIGTERM it again mid-drain")
    p.add_argument("--s3-outages", type=int, default=d.s3_outages,
                   help="windows in which every S3 request fails")
    p.add_argument("--s3-outage-seconds", type=float, default=d.s3_outage_seconds)
    p.add_argument("--poison", type=int, default=d.poison)
    p.add_argument("--engine-fail-rate", type=float, default=d.engine_fail_rate,
                   help="share of echo engine steps that fail (transient)")
    p.add_argument("--engine-poison", type=int, default=d.engine_poison,
                   help="jobs that break every engine step they are in (engine_error)")
    p.add_argument("--hangs", type=int, default=d.hangs,
                   help="workers restarted with an engine whose step hangs (exit 70)")
    p.add_argument("--engine-step-timeout", type=float, default=d.engine_step_timeout)
    p.add_argument("--idle-restarts", type=int, default=d.idle_restarts,
                   help="SIGKILL a worker and restart it at once with --until-idle 1")
    p.add_argument("--source-outages", type=int, default=d.source_outages,
                   help="SQS endpoint failing / Kafka broker down for --source-outage-seconds")
    p.add_argument("--source-outage-seconds", type=float, default=d.source_outage_seconds)
    p.add_argument("--dlq-missing-seconds", type=float, default=d.dlq_missing_seconds,
                   help="SQS: the workers' dead-letter queue is deleted this long mid-run")
    p.add_argument("--hostile", type=int, default=d.hostile,
                   help="hostile messages (every case of chaos_lib/hostile.py, in turn)")
    p.add_argument("--refusing-dlq", action="store_true",
                   help="a dead-letter target that refuses some messages for good")
    p.add_argument("--max-job-bytes", type=int, default=d.max_job_bytes,
                   help="the workers' QWORKER_MAX_JOB_BYTES when --hostile is given")
    p.add_argument("--conflicts", type=int, default=d.conflicts,
                   help="second, different requests reusing a valid job's custom_id")
    p.add_argument("--read-only-home", action="store_true",
                   help="workers run with HOME and their caches on a read-only directory")
    p.add_argument("--delay-ms", type=int, default=d.delay_ms, help="echo engine step delay")
    p.add_argument("--model", default=None, help="instead of echo:// (e.g. a tiny model dir)")
    p.add_argument("--max-inflight-jobs", type=int, default=d.max_inflight_jobs)
    p.add_argument("--sqs-visibility", type=int, default=d.sqs_visibility)
    p.add_argument("--sqs-max-receives", type=int, default=d.sqs_max_receives)
    p.add_argument("--sqs-produce-chunk", type=int, default=d.sqs_produce_chunk,
                   help="SQS: produce in chunks paced by queue depth (moto is O(depth))")
    p.add_argument("--work-dir", type=Path, default=None, help="keep logs here")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one campaign and print its report; 1 when the books do not balance."""
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    cfg = CampaignConfig(
        queue=a.queue, jobs=a.jobs, workers=a.workers, duration=a.duration, seed=a.seed,
        s3_error_rate=a.s3_error_rate, s3_latency=a.s3_latency, reset_rate=a.reset_rate,
        lost_ack_rate=a.lost_ack_rate, kills=a.kills, drains=a.drains,
        broker_restarts=a.broker_restarts, s3_outages=a.s3_outages, double_terms=a.double_terms,
        s3_outage_seconds=a.s3_outage_seconds, poison=a.poison, delay_ms=a.delay_ms, model=a.model,
        max_inflight_jobs=a.max_inflight_jobs, sqs_visibility=a.sqs_visibility,
        sqs_max_receives=a.sqs_max_receives, sqs_produce_chunk=a.sqs_produce_chunk,
        engine_fail_rate=a.engine_fail_rate, engine_poison=a.engine_poison, hangs=a.hangs,
        engine_step_timeout=a.engine_step_timeout, idle_restarts=a.idle_restarts,
        source_outages=a.source_outages, source_outage_seconds=a.source_outage_seconds,
        dlq_missing_seconds=a.dlq_missing_seconds, conflicts=a.conflicts,
        read_only_home=a.read_only_home, work_dir=a.work_dir, hostile=a.hostile,
        refusing_dlq=a.refusing_dlq, max_job_bytes=a.max_job_bytes,
    )
    report = run_campaign(cfg)
    if not a.json:
        print(report.table())
        for kind, items in report.samples.items():
            print(f"  {kind}: {items}")
        if report.log_dir:
            print(f"logs: {report.log_dir}")
    print(report.as_json())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
