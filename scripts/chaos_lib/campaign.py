"""One fault campaign: servers up, jobs in, workers under fire, then the books are checked.

Faults are tied to progress, not the clock: each planned kill, drain, broker
restart, hang, idle restart and source outage fires when the share of results in the
sink passes a threshold drawn uniformly from [5 %, 85 %], so a fast or slow machine
meets the same number of faults while work is in flight. S3 faults (5xx, resets, lost
acks, latency) come from the proxy between the workers and moto for the whole run;
SQS outages from a second proxy in front of SQS. Engine faults come from the echo
engine's fault options (random step failures, jobs that break every step, a step
that never returns). Every worker's exit code is checked against the contract
(docs/operations.md). The hostile-input campaign (``hostile``, ``refusing_dlq``) adds
messages built to break a worker (``chaos_lib.hostile``) on any of the three sources
(``queue`` "kafka", "sqs" or "file", the embedded spool with one worker), and a
dead-letter target that refuses some of them (SQS: a DLQ with a 1 KiB size limit;
Kafka: a DLQ topic whose schema takes JSON objects only): every hostile job must get
exactly one record with its code, every other hostile message must reach the
dead-letter target or the sink's ``_dead_letters/``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checker import CheckResult, check_results, error_code, list_keys
from .fleet import Fate, Fleet
from .hostile import Hostile, make_hostile
from .jobs import ENGINE_POISON, JobSet, make_jobs
from .proxy import ChaosProxy
from .report import Report
from .servers import AWS_ENV, MotoServer, TansuBroker, read_only_dir

log = logging.getLogger(__name__)

RESULTS_BUCKET = "chaos-results"


@dataclass(slots=True)
class CampaignConfig:
    """Everything a campaign varies; defaults are the full Kafka campaign."""

    queue: str = "kafka"                 # "kafka" | "sqs" | "file" (one worker on a spool)
    jobs: int = 2000
    workers: int = 3
    duration: float = 1200.0             # give up (and fail) after this many seconds
    seed: int = 1
    s3_error_rate: float = 0.05
    s3_latency: float = 0.0
    reset_rate: float = 0.02
    lost_ack_rate: float = 0.02
    kills: int = 4
    drains: int = 2
    broker_restarts: int = 1
    double_terms: int = 0                # SIGTERM, then a second SIGTERM mid-drain
    s3_outages: int = 0                  # windows where every S3 request fails
    s3_outage_seconds: float = 15.0
    poison: int = 5
    invalid_share: float = 0.02
    delay_ms: int = 20                   # echo engine: sleep per step
    model: str | None = None             # overrides the echo model
    until_idle: float = 6.0
    partitions: int = 6
    max_inflight_jobs: int = 64
    drain_seconds: float = 10.0
    sqs_visibility: int = 5
    sqs_max_receives: int = 6
    sqs_produce_chunk: int = 200         # produce SQS jobs in chunks paced by queue depth
    engine_fail_rate: float = 0.0        # echo steps that fail at random (transient)
    engine_poison: int = 0               # jobs that break every step they are in
    hangs: int = 0                       # a worker restarted with an engine that hangs
    engine_step_timeout: float = 5.0
    idle_restarts: int = 0               # SIGKILL + at once a fresh worker, --until-idle 1
    source_outages: int = 0              # SQS endpoint failing / Kafka broker down
    source_outage_seconds: float = 8.0
    dlq_missing_seconds: float = 0.0     # SQS: the workers' DLQ is gone this long mid-run
    conflicts: int = 0                   # second requests reusing a valid job's custom_id
    read_only_home: bool = False         # HOME (and XDG/HF caches) on a read-only directory
    hostile: int = 0                     # hostile messages (chaos_lib.hostile), all cases
    refusing_dlq: bool = False           # a dead-letter target that refuses some messages
    max_job_bytes: int = 64 << 10        # the workers' QWORKER_MAX_JOB_BYTES with hostile
    work_dir: Path | None = None
    moto_url: str | None = None          # reuse a running moto (tests' fixture)
    kafka_bootstrap: str | None = None   # reuse a running broker (no broker restarts then)
    keep_logs: bool = False


def _s3(url: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _sqs(url: str) -> Any:
    import boto3

    return boto3.client("sqs", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def _qworker(args: list[str], env: dict[str, str], log_path: Path) -> None:
    import os

    with log_path.open("ab") as out:
        rc = subprocess.run([sys.executable, "-m", "qworker", *args], stdout=out,
                            stderr=subprocess.STDOUT, env={**os.environ, **AWS_ENV, **env},
                            timeout=300).returncode
    if rc != 0:
        raise RuntimeError(f"qworker {args[0]} exited {rc}; see {log_path}")


class Campaign:
    """Runs one campaign described by a ``CampaignConfig``; see ``run_campaign``."""

    def __init__(self, cfg: CampaignConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.dir = cfg.work_dir or Path(tempfile.mkdtemp(prefix=f"chaos-{cfg.queue}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.report = Report(cfg.queue, cfg.seed, log_dir=str(self.dir))
        self.moto: MotoServer | None = None
        self.broker: TansuBroker | None = None
        self.proxy: ChaosProxy | None = None
        self.fleet: Fleet | None = None
        self.batch_id = f"chaos-{cfg.seed}"
        self.prefix = f"run-{cfg.queue}-{cfg.seed}-{uuid.uuid4().hex[:8]}"
        # Unique names: tests share one broker and one moto for the whole session.
        self.topic = f"chaos-jobs-{self.prefix}"
        self.group = f"chaos-{self.prefix}"
        self.jobs: JobSet = make_jobs(cfg.jobs, self.batch_id, self.rng, cfg.invalid_share,
                                      cfg.poison, engine_poison=cfg.engine_poison,
                                      conflicts=cfg.conflicts)
        self.hostile: list[Hostile] = make_hostile(cfg.hostile, self.batch_id, self.rng,
                                                   cfg.max_job_bytes,
                                                   text_only=cfg.queue == "sqs")
        for h in self.hostile:  # their records are checked like any job's
            if h.custom_id is not None:
                self.jobs.expected[h.custom_id] = h.code or "ok"
                self.jobs.nonces[h.custom_id] = h.nonce or "nonce-none"
        self.spool = self.dir / "spool.jsonl"
        self.schema_dir = self.dir / "schema"
        self._dlq_back_at: float | None = None
        self.sqs_proxy: ChaosProxy | None = None
        self._source_outage_ends: float | None = None
        self.late_dlq_url = ""
        self.source_uri = ""
        self._trickle: threading.Thread | None = None
        self._trickle_error: Exception | None = None
        self._outage_ends: float | None = None
        self.dlq_url = ""
        self.queue_url = ""
        self._sink_letters: list[bytes] = []
        self._late_dlq_attrs: dict[str, str] = {}
        self._saved_dlq: list[bytes] = []  # DLQ contents read before the campaign deleted it

    # -- setup ---------------------------------------------------------------------
    def _start_servers(self) -> str:
        moto_url = self.cfg.moto_url
        if moto_url is None:
            self.moto = MotoServer(self.dir)
            self.moto.start()
            moto_url = self.moto.url
        s3 = _s3(moto_url)
        for bucket in (RESULTS_BUCKET, "tansu"):
            with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
                s3.create_bucket(Bucket=bucket)
        if self.cfg.queue == "kafka" and (self.cfg.kafka_bootstrap is None
                                          or self.cfg.refusing_dlq):
            schemas = None
            if self.cfg.refusing_dlq:
                # The DLQ topic takes JSON objects only: tansu refuses the rest for good.
                self.schema_dir.mkdir(exist_ok=True)
                (self.schema_dir / f"{self.topic}.dlq.json").write_text(
                    '{"type": "object", "properties": {"value": {"type": "object"}}}')
                schemas = self.schema_dir
            self.broker = TansuBroker(self.dir, s3_url=moto_url, schema_dir=schemas)
            self.broker.start()
        self.proxy = ChaosProxy(moto_url, error_rate=self.cfg.s3_error_rate,
                                latency=self.cfg.s3_latency, reset_rate=self.cfg.reset_rate,
                                lost_ack_rate=self.cfg.lost_ack_rate, seed=self.cfg.seed)
        self.proxy.start()
        if self.cfg.queue == "sqs":
            self.sqs_proxy = ChaosProxy(moto_url, seed=self.cfg.seed + 1)  # faults on demand
            self.sqs_proxy.start()
        return moto_url

    def _bootstrap(self) -> str:
        if self.broker is not None:
            return self.broker.bootstrap
        assert self.cfg.kafka_bootstrap is not None
        return self.cfg.kafka_bootstrap

    async def _kafka_setup(self) -> None:
        from aiokafka import AIOKafkaProducer
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap())
        await admin.start()
        try:
            await admin.create_topics([NewTopic(self.topic, self.cfg.partitions, 1),
                                       NewTopic(f"{self.topic}.dlq", 1, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap())
        await producer.start()
        try:
            for i, body in enumerate(self.jobs.poison):
                await producer.send_and_wait(self.topic, body, key=f"poison-{i}".encode())
            for line in self.jobs.conflict_lines:  # around `produce`, which refuses them
                await producer.send_and_wait(self.topic, json.dumps(line).encode(),
                                             key=line["custom_id"].encode())
            for h in self.hostile:
                await producer.send_and_wait(self.topic, h.body)
        finally:
            await producer.stop()

    def _sqs_setup(self, moto_url: str) -> None:
        sqs = _sqs(moto_url)
        self.dlq_url = sqs.create_queue(QueueName=f"chaos-dlq-{self.prefix}")["QueueUrl"]
        if self.cfg.refusing_dlq:
            # The workers' DLQ takes 1 KiB at most: larger dead letters are refused for good.
            self._late_dlq_attrs = {"MaximumMessageSize": "1024"}
            self.late_dlq_url = sqs.create_queue(
                QueueName=f"chaos-small-dlq-{self.prefix}",
                Attributes=self._late_dlq_attrs)["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=self.dlq_url, AttributeNames=["QueueArn"])[
            "Attributes"]["QueueArn"]
        policy = json.dumps({"deadLetterTargetArn": arn,
                             "maxReceiveCount": str(self.cfg.sqs_max_receives)})
        self.queue_url = sqs.create_queue(
            QueueName=f"chaos-jobs-{self.prefix}",
            Attributes={"VisibilityTimeout": str(self.cfg.sqs_visibility),
                        "RedrivePolicy": policy})["QueueUrl"]
        for body in self.jobs.poison:
            # SQS bodies are text: poison is non-JSON text, not invalid UTF-8.
            sqs.send_message(QueueUrl=self.queue_url,
                             MessageBody=body.decode("utf-8", "replace"))
        for line in self.jobs.conflict_lines:  # around `produce`, which refuses them
            sqs.send_message(QueueUrl=self.queue_url, MessageBody=json.dumps(line),
                             MessageAttributes={"custom_id": {
                                 "DataType": "String", "StringValue": line["custom_id"]}})
        for h in self.hostile:
            sqs.send_message(QueueUrl=self.queue_url, MessageBody=h.body.decode("utf-8"))
        if self.cfg.dlq_missing_seconds and not self.late_dlq_url:
            # The workers' own DLQ, deleted mid-run for dlq_missing_seconds (``_fire``).
            self.late_dlq_url = sqs.create_queue(
                QueueName=f"chaos-late-dlq-{self.prefix}")["QueueUrl"]

    def _produce(self, moto_url: str) -> None:
        if self.cfg.queue == "kafka":
            asyncio.run(self._kafka_setup())
            self.source_uri = f"kafka://{self._bootstrap()}/{self.topic}?group={self.group}"
            self._produce_file(self.jobs.lines, "jobs.jsonl")
        elif self.cfg.queue == "file":
            self.source_uri = f"file://{self.spool}"
            for stale in (".progress", ".dlq"):  # a reused work dir: start a fresh spool
                self.spool.with_name(self.spool.name + stale).unlink(missing_ok=True)
            with self.spool.open("wb") as out:  # raw lines first: produce appends the jobs
                for body in [*self.jobs.poison, *(json.dumps(x).encode()
                                                  for x in self.jobs.conflict_lines),
                             *(h.body for h in self.hostile)]:
                    out.write(body + b"\n")
            self._produce_file(self.jobs.lines, "jobs.jsonl")
        else:
            self._sqs_setup(moto_url)
            self.source_uri = f"sqs://{self.queue_url}"
            size = self.cfg.sqs_produce_chunk
            chunks = [self.jobs.lines[i:i + size] for i in range(0, len(self.jobs.lines), size)]
            self._produce_file(chunks[0], "jobs-0.jsonl")
            if len(chunks) > 1:
                self._trickle = threading.Thread(target=self._trickle_produce,
                                                 args=(chunks[1:], moto_url), daemon=True)
                self._trickle.start()
        self.report.jobs_produced = len(self.jobs.lines)
        self.report.poison_produced = len(self.jobs.poison)
        self.report.hostile_produced = len(self.hostile)
        self.report.hostile_jobs = sum(1 for h in self.hostile if h.custom_id is not None)

    def _produce_file(self, lines: list[dict], name: str) -> None:
        path = self.dir / name
        JobSet(self.batch_id, lines).write(path)
        env = {"QWORKER_SQS_ENDPOINT_URL": self.cfg.moto_url or (self.moto.url if self.moto
                                                                  else "")}
        results = ["--results", f"s3://{RESULTS_BUCKET}/{self.prefix}"]
        if self.cfg.queue == "sqs" or self.hostile:
            # SQS: produced in chunks, no one file holds the batch; hostile jobs are sent
            # around produce (which refuses them), so no manifest lists them.
            results = ["--no-manifest"]
        env["QWORKER_S3_ENDPOINT_URL"] = self.cfg.moto_url or (self.moto.url if self.moto
                                                                else "")
        # the campaign mixes chat and completion jobs in one batch on purpose
        _qworker(["produce", "-i", str(path), "--to", self.source_uri,
                  "--batch-id", self.batch_id, "--allow-mixed", *results], env,
                 self.dir / "produce.log")

    def _trickle_produce(self, chunks: list[list[dict]], moto_url: str) -> None:
        """Produce the remaining SQS chunks whenever the queue runs low.

        moto's SQS scans every message of a queue on each call (O(depth)), so a queue
        2,000 deep makes each call take seconds; pacing keeps the depth near one chunk.
        """
        sqs = _sqs(moto_url)
        try:
            for k, chunk in enumerate(chunks, start=1):
                while True:
                    attrs = sqs.get_queue_attributes(
                        QueueUrl=self.queue_url,
                        AttributeNames=["ApproximateNumberOfMessages"])["Attributes"]
                    if int(attrs["ApproximateNumberOfMessages"]) < len(chunk) // 2:
                        break
                    time.sleep(0.5)
                self._produce_file(chunk, f"jobs-{k}.jsonl")
        except Exception as exc:  # surfaced by _run_fleet
            self._trickle_error = exc

    def _worker_env(self, moto_url: str) -> dict[str, str]:
        assert self.proxy is not None
        env = {
            "QWORKER_S3_ENDPOINT_URL": self.proxy.url,
            "QWORKER_SQS_ENDPOINT_URL": moto_url,
            "QWORKER_DRAIN_SECONDS": str(self.cfg.drain_seconds),
            "QWORKER_SPOT_METADATA_URL": "",
            "QWORKER_KAFKA_SESSION_TIMEOUT_MS": "3000",
            "QWORKER_KAFKA_COMMIT_INTERVAL_SECONDS": "1",
            "QWORKER_MAX_INFLIGHT_JOBS": str(self.cfg.max_inflight_jobs),
            "QWORKER_LOG_FORMAT": "json",
            "QWORKER_ENGINE_STEP_TIMEOUT": str(self.cfg.engine_step_timeout),
        }
        if self.cfg.model:  # the jobs name the echo model (chaos_lib/jobs.py)
            env["QWORKER_MODEL_ALIASES"] = "echo"
        if self.hostile:
            env["QWORKER_MAX_JOB_BYTES"] = str(self.cfg.max_job_bytes)
        if self.cfg.queue == "sqs":
            assert self.sqs_proxy is not None
            env["QWORKER_SQS_ENDPOINT_URL"] = self.sqs_proxy.url
            env["QWORKER_SQS_VISIBILITY_TIMEOUT"] = str(self.cfg.sqs_visibility)
            env["QWORKER_SQS_DLQ_URL"] = self.late_dlq_url or self.dlq_url
        if self.cfg.read_only_home:
            home = str(read_only_dir(self.dir))
            env.update(HOME=home, XDG_CACHE_HOME=f"{home}/.cache", HF_HOME=f"{home}/.hf")
        return env

    def _model(self, **extra: object) -> str:
        cfg = self.cfg
        if cfg.model:
            return cfg.model
        opts: dict[str, object] = {"delay_ms": cfg.delay_ms}
        if cfg.engine_fail_rate:
            opts.update(fail_rate=cfg.engine_fail_rate, seed=cfg.seed)
        if cfg.engine_poison:
            opts["poison"] = ENGINE_POISON
        opts.update(extra)
        return "echo://?" + "&".join(f"{k}={v}" for k, v in opts.items())

    def _argv(self, model: str, until_idle: float) -> list[str]:
        return ["run", "--source", self.source_uri,
                "--sink", f"s3://{RESULTS_BUCKET}/{self.prefix}", "--model", model,
                "--until-idle", str(until_idle)]

    # -- the run -------------------------------------------------------------------
    def _plan(self) -> list[tuple[float, str]]:
        cfg = self.cfg
        kinds = ["kill"] * cfg.kills + ["drain"] * cfg.drains + ["outage"] * cfg.s3_outages \
            + ["term2"] * cfg.double_terms + ["hang"] * cfg.hangs \
            + ["idle_restart"] * cfg.idle_restarts
        if cfg.queue == "kafka" and self.broker is not None:
            kinds += ["broker"] * cfg.broker_restarts + ["source_outage"] * cfg.source_outages
        elif cfg.queue == "sqs":
            kinds += ["source_outage"] * cfg.source_outages
            kinds += ["dlq_outage"] * (1 if cfg.dlq_missing_seconds else 0)
        return sorted((self.rng.uniform(0.05, 0.85), k) for k in kinds)

    def _fire(self, kind: str) -> bool:
        assert self.fleet is not None and self.proxy is not None
        if kind == "outage":
            log.info("S3 outage for %.0f s", self.cfg.s3_outage_seconds)
            self.proxy.configure(error_rate=1.0 - self.cfg.reset_rate)
            self._outage_ends = time.monotonic() + self.cfg.s3_outage_seconds
            self.report.s3_outages += 1
            return True
        if kind == "dlq_outage":
            # The workers' DLQ is gone for a while; a dead letter meets it missing (retried,
            # never lost). Workers started meanwhile may exit 1 at start: a configured DLQ
            # that does not exist is a configuration error (docs/operations.md).
            seconds = self.cfg.dlq_missing_seconds
            log.info("the workers' DLQ is deleted for %.0f s", seconds)
            sqs = _sqs(self.cfg.moto_url or (self.moto.url if self.moto else ""))
            self._saved_dlq += self._receive_all(sqs, self.late_dlq_url)  # deleted with it
            sqs.delete_queue(QueueUrl=self.late_dlq_url)
            self._dlq_back_at = time.monotonic() + seconds
            # Workers still starting (their DLQ check) or started meanwhile may exit 1.
            self.fleet.allow_config_exits(since=time.monotonic() - 60,
                                          until=self._dlq_back_at + 1.0)
            body = b"[\"poison while the DLQ is missing\"]"
            self.jobs.poison.append(body)
            self.report.poison_produced += 1
            sqs.send_message(QueueUrl=self.queue_url, MessageBody=body.decode())
            return True
        if kind == "broker":
            assert self.broker is not None
            log.info("restarting the broker")
            self.broker.restart(self.rng.uniform(0.5, 2.0))
            self.report.broker_restarts += 1
            return True
        if kind == "source_outage":
            seconds = self.cfg.source_outage_seconds
            log.info("source outage for %.0f s", seconds)
            self.report.source_outages += 1
            if self.sqs_proxy is not None:
                self.sqs_proxy.configure(error_rate=1.0)
                self._source_outage_ends = time.monotonic() + seconds
            else:
                assert self.broker is not None
                threading.Thread(target=self.broker.restart, args=(seconds,),
                                 daemon=True).start()
            return True
        live = self.fleet.live()
        # Leave a worker that is about to hang alone (its exit 70 is what is tested): the
        # fault waits for another worker.
        live = [sl for sl in live if sl.current and sl.current.tag != "hang"]
        if not live:
            return False
        slot = self.rng.choice(live)
        if kind == "hang":
            log.info("worker %d restarted with an engine that hangs", slot.index)
            # 70 once it hung; 0 only if it never met enough work to reach the hang.
            self.fleet.kill(slot, restart_after=0.2, tag="hang", expect_rc=(70, 0),
                            argv=self._argv(self._model(hang_after=self.rng.randint(1, 3)),
                                            self.cfg.until_idle))
            self.report.hangs += 1
        elif kind == "idle_restart":
            log.info("SIGKILL worker %d, restart at once with --until-idle 1", slot.index)
            self.fleet.kill(slot, restart_after=0.1, tag="idle-restart",
                            argv=self._argv(self._model(), 1.0))
            self.report.idle_restarts += 1
        elif kind == "term2":
            log.info("SIGTERM twice worker %d", slot.index)
            self.fleet.interrupt_drain(slot, self.rng.uniform(0.1, 1.0), self.rng.uniform(0.3, 2))
            self.report.double_terms += 1
        elif kind == "kill":
            log.info("SIGKILL worker %d", slot.index)
            self.fleet.kill(slot, restart_after=self.rng.uniform(0.3, 2.0))
            self.report.kills += 1
        else:
            log.info("SIGTERM worker %d", slot.index)
            self.fleet.drain(slot)
            self.report.drains += 1
        return True

    def _run_fleet(self, moto_url: str) -> None:
        cfg = self.cfg
        argv = self._argv(self._model(), cfg.until_idle)
        workers = 1 if cfg.queue == "file" else cfg.workers  # a spool takes one worker
        self.fleet = Fleet(workers, argv, self._worker_env(moto_url), self.dir, self.rng)
        s3 = _s3(moto_url)
        listing = f"{self.prefix}/"
        plan = self._plan()
        expected = len(self.jobs.expected)
        deadline = time.monotonic() + cfg.duration
        self.fleet.progress_fn = lambda: self._results(s3, listing)
        self.fleet.start()
        last_count = -1
        while time.monotonic() < deadline:
            count = self._results(s3, listing)
            if count != last_count:
                log.info("progress %d/%d", count, expected)
                last_count = count
            while plan and count >= plan[0][0] * expected and self._fire(plan[0][1]):
                plan.pop(0)
            if self._outage_ends is not None and time.monotonic() >= self._outage_ends:
                assert self.proxy is not None
                self.proxy.configure(error_rate=cfg.s3_error_rate)
                self._outage_ends = None
                log.info("S3 outage over")
            if self._source_outage_ends is not None and \
                    time.monotonic() >= self._source_outage_ends:
                assert self.sqs_proxy is not None
                self.sqs_proxy.configure(error_rate=0.0)
                self._source_outage_ends = None
                log.info("source outage over")
            if self._dlq_back_at is not None and time.monotonic() >= self._dlq_back_at:
                name = self.late_dlq_url.rsplit("/", 1)[1]
                _sqs(moto_url).create_queue(QueueName=name, Attributes=self._late_dlq_attrs)
                self._dlq_back_at = None
                log.info("the workers' DLQ is back")
            if self._trickle_error is not None:
                raise RuntimeError("producing jobs failed") from self._trickle_error
            if count >= expected and not plan and self._outage_ends is None \
                    and self._source_outage_ends is None and self._dlq_back_at is None:
                break
            self.fleet.tick(want_workers=True, progress=count)
            time.sleep(0.3)
        self.fleet.settle(cfg.until_idle + 40)
        if cfg.queue == "sqs":
            self._settle_sqs(moto_url, rounds=3)

    def _results(self, s3: Any, listing: str) -> int:
        """Result objects in the sink now (qworker's own ``_`` objects left out)."""
        return sum(1 for k in list_keys(s3, RESULTS_BUCKET, listing)
                   if not any(p.startswith("_") for p in k[len(listing):].split("/")))

    def _settle_sqs(self, moto_url: str, rounds: int) -> None:
        """Settle again while the queue still holds messages.

        Messages a SIGKILLed worker held (results written, deletes not sent) reappear only
        when their visibility timeout runs out, which can be after the settling workers
        went idle: wait it out and let a fresh round absorb them as duplicates.
        """
        sqs = _sqs(moto_url)
        for _ in range(rounds):
            attrs = sqs.get_queue_attributes(
                QueueUrl=self.queue_url,
                AttributeNames=["ApproximateNumberOfMessages",
                                "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
            left = sum(int(v) for v in attrs.values())
            if not left:
                return
            log.info("settle: %d message(s) still queued or in flight; waiting out visibility",
                     left)
            time.sleep(self.cfg.sqs_visibility + 1)
            self.fleet.settle(self.cfg.until_idle + 40)

    # -- the books -----------------------------------------------------------------
    async def _kafka_books(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(bootstrap_servers=self._bootstrap(), group_id=self.group,
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(self.topic, p) for p in range(self.cfg.partitions)]
            # tansu's ListOffsets(latest) answers per record batch, not per record, so the
            # lag is what was produced to the fresh topic minus what the group committed.
            committed = [await consumer.committed(tp) or 0 for tp in tps]
            log.info("committed offsets per partition: %s", committed)
            produced = (self.report.jobs_produced + self.report.poison_produced
                        + len(self.jobs.conflict_lines) + len(self.hostile))
            self.report.final_lag = produced - sum(committed)
        finally:
            await consumer.stop()
        dlq = AIOKafkaConsumer(f"{self.topic}.dlq", bootstrap_servers=self._bootstrap(),
                               auto_offset_reset="earliest", enable_auto_commit=False)
        await dlq.start()
        bodies: list[bytes] = []
        try:
            while True:
                batch = await dlq.getmany(timeout_ms=1500)
                if not batch:
                    break
                bodies += [m.value for ms in batch.values() for m in ms]
        finally:
            await dlq.stop()
        self._count_dlq(bodies)

    def _sqs_books(self, moto_url: str) -> None:
        sqs = _sqs(moto_url)
        attrs = sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages",
                            "ApproximateNumberOfMessagesNotVisible",
                            "ApproximateNumberOfMessagesDelayed"])["Attributes"]
        self.report.final_lag = sum(int(v) for v in attrs.values())
        bodies: list[bytes] = list(self._saved_dlq)
        for url in {self.dlq_url, self.late_dlq_url} - {""}:  # redrive DLQ + the workers'
            bodies += self._receive_all(sqs, url)
        self._count_dlq(bodies)

    @staticmethod
    def _receive_all(sqs: Any, url: str) -> list[bytes]:
        bodies: list[bytes] = []
        while True:
            got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10,
                                      VisibilityTimeout=600,
                                      WaitTimeSeconds=0).get("Messages", [])
            if not got:
                return bodies
            bodies += [m["Body"].encode() for m in got]

    def _file_books(self) -> None:
        lines = [n for n, raw in enumerate(self.spool.read_bytes().split(b"\n"), 1)
                 if raw.strip()]
        done: set[int] = set()
        progress = self.spool.with_name(self.spool.name + ".progress")
        for raw in progress.read_text().splitlines() if progress.exists() else []:
            if raw.startswith("done_through "):
                done.update(range(1, int(raw.split()[1]) + 1))
            elif raw.strip().isdigit():
                done.add(int(raw))
        self.report.final_lag = len(set(lines) - done)
        bodies: list[bytes] = []
        dlq = self.spool.with_name(self.spool.name + ".dlq")
        for raw in dlq.read_text().splitlines() if dlq.exists() else []:
            rec = json.loads(raw)
            bodies.append(base64.b64decode(rec["body_base64"]) if "body_base64" in rec
                          else rec["body"].encode())
        self._count_dlq(bodies)

    def _sink_dead_letters(self, moto_url: str) -> list[bytes]:
        s3 = _s3(moto_url)
        keys = list_keys(s3, RESULTS_BUCKET, f"{self.prefix}/_dead_letters/")
        return [base64.b64decode(json.loads(s3.get_object(Bucket=RESULTS_BUCKET, Key=k)[
            "Body"].read())["body_base64"]) for k in keys]

    def _count_dlq(self, bodies: list[bytes]) -> None:
        self.report.dead_lettered = len(bodies)
        sink = self._sink_letters
        self.report.sink_dead_letters = len(sink)
        bodies = bodies + sink
        poison = {p.decode("utf-8", "replace").encode() for p in self.jobs.poison} \
            | set(self.jobs.poison)
        self.report.poison_in_dlq = len({b for b in bodies if b in poison})
        found = set(bodies) | {b.decode("utf-8", "replace").encode() for b in bodies}
        dead = [h for h in self.hostile if h.custom_id is None]
        # A spool's dead letter keeps a line's first max_job_bytes + 1 bytes only.
        head = self.cfg.max_job_bytes + 1
        missing = [h.kind for h in dead if h.body not in found
                   and h.body.decode("utf-8", "replace").encode() not in found
                   and h.body[:head] not in found]
        self.report.hostile_dead_expected = len(dead)
        self.report.hostile_dead_missing = len(missing)
        if missing:
            self.report.samples["hostile_not_dead_lettered"] = missing[:5]
        valid = 0
        for b in bodies:
            with contextlib.suppress(ValueError, RecursionError):  # hostile bodies, too
                rec = json.loads(b)
                if isinstance(rec, dict) and rec.get("custom_id") in self.jobs.expected:
                    valid += 1
        self.report.valid_jobs_in_dlq = valid

    def _collect(self, moto_url: str) -> None:
        """``qworker collect`` must give one line per job: results and errors apart."""
        out, err = self.dir / "collected.jsonl", self.dir / "collected-errors.jsonl"
        _qworker(["collect", "--from", f"s3://{RESULTS_BUCKET}/{self.prefix}",
                  "--batch-id", self.batch_id, "-o", str(out), "--errors", str(err)],
                 {"QWORKER_S3_ENDPOINT_URL": moto_url}, self.dir / "collect.log")
        got: dict[str, str] = {}
        bad = 0
        conflict_lines = 0
        for path, kind in ((out, "ok"), (err, "error")):
            if not path.exists():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                if error_code(rec) == "duplicate_custom_id":
                    conflict_lines += 1  # a conflict record, beside the job's own line
                    bad += kind != "error"
                    continue
                cid = rec.get("custom_id")
                if cid in got:
                    bad += 1
                got[cid] = "ok" if error_code(rec) is None else "error"
                if got[cid] != kind:
                    bad += 1
        for cid, want in self.jobs.expected.items():
            if got.get(cid) != ("ok" if want == "ok" else "error"):
                bad += 1
        bad += len(set(got) - set(self.jobs.expected))
        bad += abs(conflict_lines - len(self.jobs.conflict_lines))
        self.report.collect_mismatches = bad

    def _books(self, moto_url: str) -> CheckResult:
        from qworker.schema import conflict_key, request_fingerprint, result_key

        r = self.report
        check = check_results(
            _s3(moto_url), RESULTS_BUCKET, f"{self.prefix}/", self.jobs,
            lambda cid: result_key(self.prefix, self.batch_id, cid),
            lambda line: conflict_key(self.prefix, self.batch_id, line["custom_id"],
                                      request_fingerprint(line["url"], line["body"])))
        r.results_found, r.missing = check.found, len(check.missing)
        r.duplicates, r.invalid = len(check.duplicates), len(check.invalid)
        r.unexpected, r.error_records = len(check.unexpected), check.error_records
        r.conflicts_produced = len(self.jobs.conflict_lines)
        r.conflict_records = check.conflict_records
        r.silently_replaced = len(check.silently_replaced)
        r.bad_conflicts = len(check.bad_conflicts)
        r.engine_poison_jobs = sum(1 for v in self.jobs.expected.values() if v == "engine_error")
        r.samples = {k: v[:5] for k, v in (("missing", check.missing),
                                          ("duplicates", check.duplicates),
                                          ("invalid", check.invalid),
                                          ("unexpected", check.unexpected),
                                          ("silently_replaced", check.silently_replaced),
                                          ("bad_conflicts", check.bad_conflicts)) if v}
        self._collect(moto_url)
        self._sink_letters = self._sink_dead_letters(moto_url)
        if self.cfg.queue == "kafka":
            asyncio.run(self._kafka_books())
        elif self.cfg.queue == "file":
            self._file_books()
        else:
            self._sqs_books(moto_url)
        assert self.fleet is not None and self.proxy is not None
        incs = self.fleet.incarnations()
        r.worker_starts = len(incs)
        exited = [i for i in incs if i.fate is Fate.EXITED]
        r.worker_crashes = sum(1 for i in exited if i.returncode not in i.expect_rc)
        r.idle_exits = sum(1 for i in exited if i.returncode == 0)
        # --until-idle may only exit 0 when no work is pending anywhere: by then every
        # result is stored (messages are deleted / offsets committed after the write).
        r.idle_exits_with_work_left = sum(
            1 for i in exited if i.returncode == 0 and i.progress_at_exit is not None
            and i.progress_at_exit < len(self.jobs.expected))
        r.exit_codes = dict(sorted(Counter(
            f"{i.tag or i.fate.value}:{i.returncode}" for i in incs).items()))
        drains = [i for i in incs if i.fate is Fate.DRAINED]
        # A drain exits 75 when it left work (its own or the queue's), 0 when none was left.
        r.drain_bad_exits = sum(1 for i in drains if i.returncode not in (0, 75))
        r.drain_seconds = [round((i.ended_at or 0) - (i.signalled_at or 0), 1) for i in drains]
        r.drain_max_seconds = max(r.drain_seconds, default=0.0)
        received = self.fleet.metric_total("qworker_jobs_received_total")
        r.redeliveries = max(0, int(received) - r.jobs_produced - r.poison_produced
                             - len(self.hostile) - len(self.jobs.conflict_lines))
        r.duplicates_reported_by_workers = int(self.fleet.metric_total(
            "qworker_jobs_duplicate_total"))
        r.faults = self.proxy.faults
        r.duplicates_absorbed_412 = r.faults.get("s3_412", 0)
        return check

    def run(self) -> Report:
        """Run the whole campaign and return its report (servers and workers are stopped)."""
        start = time.monotonic()
        try:
            moto_url = self._start_servers()
            self._produce(moto_url)
            self._run_fleet(moto_url)
            self._books(moto_url)
        finally:
            self.report.wall_seconds = time.monotonic() - start
            if self.fleet is not None:
                self.fleet.close()
            if self.proxy is not None:
                self.proxy.stop()
            if self.sqs_proxy is not None:
                self.sqs_proxy.stop()
            if self.broker is not None:
                self.broker.stop()
            if self.moto is not None:
                self.moto.stop()
        if self.report.ok and not self.cfg.keep_logs and self.cfg.work_dir is None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.report.log_dir = ""
        return self.report


def run_campaign(cfg: CampaignConfig) -> Report:
    """Run one campaign (see the module docstring) and return its ``Report``."""
    return Campaign(cfg).run()
