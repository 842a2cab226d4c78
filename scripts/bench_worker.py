"""Worker throughput and KV-pool usage: source -> worker -> sink, side by side.

Runs, in one process and one go:
  1. echo engine (no model): jobs/s through the worker; the per-job time is the worker's
     own overhead (parse, admission, thread hand-off, record, sink put, ack);
  2. a tiny random Llama, the same jobs straight through ``Engine.step`` (no worker) and
     through the worker: the difference per job is the worker's overhead with a real engine;
  3. a saturating queue into a small KV pool: time-averaged pool usage and the share of
     requests preempted (target >= 90% usage with < 2% preempted).
Sources/sinks default to file:// under a temp dir; pass ``--source kafka://...`` /
``--sink s3://...`` (with the servers running and QWORKER_* endpoints set) to go through them.
Prints a table and one JSON line. Never asserts on time.

    python scripts/bench_worker.py [--jobs 2000] [--model-jobs 120] [--saturate-jobs 400]
                                   [--source URI --sink URI]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qworker.config import WorkerSettings
from qworker.engine.sampling_params import SamplingParams
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.engine_thread import EngineLike
from qworker.worker.sinks import open_sink, sink_prefix
from qworker.worker.sources import open_source, produce
from qworker.worker.summary import RunSummary
from qworker.worker.worker import Worker


def make_jobs(
    n: int, rng: random.Random, vocab: int, prompt_len: tuple[int, int], out_len: tuple[int, int]
) -> list[bytes]:
    """Completion jobs with token-id prompts (no tokenizer needed), forced output lengths."""
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        body = {
            "prompt": prompt,
            "max_tokens": rng.randint(*out_len),
            "ignore_eos": True,
            "temperature": 0,
        }
        jobs.append(
            json.dumps(
                {
                    "custom_id": f"bench-{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": body,
                }
            ).encode()
        )
    return jobs


async def through_worker(
    engine: EngineLike, jobs: list[bytes], source: str, sink: str, **settings: Any
) -> RunSummary:
    """Produce ``jobs`` to ``source`` and run one worker until idle."""
    cfg = WorkerSettings(
        source=source,
        sink=sink,
        model="echo://",
        until_idle=1.0,
        metrics_port=0,
        spot_metadata_url="",
        **settings,
    )
    await asyncio.to_thread(produce, source, ((None, b) for b in jobs), cfg)
    worker = Worker(cfg, engine, open_source(source, cfg), open_sink(sink, cfg), sink_prefix(sink))
    return await worker.run()  # the summary leaves the until_idle wait out


def engine_only(engine: EngineLike, jobs: list[bytes]) -> float:
    """Seconds to run the same jobs straight through ``engine.step`` (no worker).

    Steps on a separate thread, as the worker does (torch in the main thread was
    measured many times slower on an oversubscribed 2-core machine).
    """
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(_engine_only(engine, jobs)))
    thread.start()
    thread.join()
    return result[0]


def _engine_only(engine: EngineLike, jobs: list[bytes]) -> float:
    started = time.monotonic()
    for raw in jobs:
        body = json.loads(raw)["body"]
        engine.add_request(
            uuid.uuid4().hex,
            body["prompt"],
            SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True, temperature=0),
        )
    while engine.has_unfinished():
        engine.step()
    return time.monotonic() - started


def tiny_engine(tmp: Path, num_kv_blocks: int, max_num_seqs: int) -> EngineLike:
    from qworker.engine.config import EngineConfig
    from qworker.engine.engine import Engine
    from tests.fixtures.models import make_tiny_model_dir

    model = tmp / "tiny-llama"
    if not model.exists():
        make_tiny_model_dir("llama", model, seed=0)
    return Engine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            num_kv_blocks=num_kv_blocks,
            block_size=16,
            max_num_seqs=max_num_seqs,
            max_model_len=512,
        )
    )


def _uris(args: argparse.Namespace, tmp: Path, tag: str) -> tuple[str, str]:
    source = args.source or f"file://{tmp}/{tag}.jsonl"
    sink = args.sink or f"file://{tmp}/{tag}-out"
    if args.source and args.source.startswith("file://"):
        source = f"{args.source.rstrip('/')}-{tag}"
    return source, sink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="echo-engine jobs")
    parser.add_argument("--model-jobs", type=int, default=120, help="tiny-model jobs")
    parser.add_argument("--saturate-jobs", type=int, default=400, help="saturating-queue jobs")
    parser.add_argument("--pool-blocks", type=int, default=256, help="KV pool of that run")
    parser.add_argument("--source", help="source URI (default: a temp file:// spool)")
    parser.add_argument("--sink", help="sink URI (default: a temp file:// dir)")
    parser.add_argument("--skip-model", action="store_true", help="echo engine only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rng = random.Random(0)
    rows: list[tuple[str, int, float, str]] = []
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        jobs = make_jobs(args.jobs, rng, 500, (8, 64), (1, 1))
        source, sink = _uris(args, tmp, "echo")
        s = asyncio.run(through_worker(EchoEngine(), jobs, source, sink))
        done = sum(s.completed.values())
        rows.append(
            ("worker + echo engine", done, s.elapsed, f"{1e3 * s.elapsed / done:.2f} ms/job")
        )
        figures["echo"] = {
            "jobs": done,
            "seconds": round(s.elapsed, 3),
            "jobs_per_s": round(done / s.elapsed, 1),
            "overhead_ms_per_job": round(1e3 * s.elapsed / done, 3),
        }
        if not args.skip_model:
            model_jobs = make_jobs(args.model_jobs, rng, 512, (16, 96), (4, 24))
            direct = engine_only(tiny_engine(tmp, 512, 64), model_jobs)
            source, sink = _uris(args, tmp, "tiny")
            s = asyncio.run(through_worker(tiny_engine(tmp, 512, 64), model_jobs, source, sink))
            done = sum(s.completed.values())
            overhead = 1e3 * (s.elapsed - direct) / done
            rows.append(("engine.step only (tiny llama)", len(model_jobs), direct, ""))
            rows.append(("worker + tiny llama", done, s.elapsed, f"{overhead:+.2f} ms/job"))
            figures["tiny"] = {
                "jobs": done,
                "engine_only_s": round(direct, 3),
                "worker_s": round(s.elapsed, 3),
                "jobs_per_s": round(done / s.elapsed, 2),
                "overhead_ms_per_job": round(overhead, 3),
            }
            sat_jobs = make_jobs(args.saturate_jobs, rng, 512, (32, 160), (32, 128))
            source, sink = _uris(args, tmp, "saturate")
            s = asyncio.run(
                through_worker(tiny_engine(tmp, args.pool_blocks, 256), sat_jobs, source, sink)
            )
            done = sum(s.completed.values())
            preempt = s.num_preemptions / max(1, done)
            sat = s.kv_usage_saturated or 0.0
            rows.append(
                (
                    f"saturating queue, {args.pool_blocks}-block pool",
                    done,
                    s.elapsed,
                    f"KV {sat:.1%} while saturated ({s.kv_usage_mean:.1%} overall), "
                    f"{preempt:.1%} preempted",
                )
            )
            figures["saturate"] = {
                "jobs": done,
                "seconds": round(s.elapsed, 3),
                "kv_usage_saturated": round(sat, 4),
                "kv_usage_mean": round(s.kv_usage_mean, 4),
                "kv_usage_peak": round(s.kv_usage_peak, 4),
                "num_preemptions": s.num_preemptions,
                "preempted_share": round(preempt, 4),
            }
    print(f"{'run':34} {'jobs':>6} {'seconds':>8} {'jobs/s':>8}  note")
    for name, n, secs, note in rows:
        print(f"{name:34} {n:6d} {secs:8.2f} {n / max(secs, 1e-9):8.1f}  {note}")
    print(json.dumps({"bench": "worker", **figures}))


if __name__ == "__main__":
    main()
