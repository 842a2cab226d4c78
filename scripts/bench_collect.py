"""Collect and status throughput against moto S3: qworker.batch vs the sink's old collect.

Fills one batch with ``--objects`` result objects (about 600 bytes each, the size of a
short chat result) plus its manifest on a local ``moto_server``, then measures, in one
run and on the same objects:

* ``baseline``: ``qworker.worker.sinks.s3.collect`` as it was before qworker.batch
  (ListObjectsV2 pages in sequence, each page's GETs on 8 threads, listing order);
* ``collect``: ``qworker.batch.collect.collect_batch`` (manifest order; the listing cut
  into parallel key ranges at the manifest's keys; GETs on ``--workers`` threads);
* ``listing``: the listing alone, one lister vs ranged listers (what ``status`` pays
  per poll once its outcome cache holds every result).

Each is run twice: against moto directly, and through ``qworker.testing.faultproxy``
adding ``--latency`` seconds per request (default 0.02, a same-region S3 GET), where
the time goes in waiting as it does against S3 rather than in moto's CPU. Prints a
table and one JSON line (``--out`` also writes it). moto is one Python process: on a
small, busy machine the direct figures are moto's CPU, not S3's. Never asserts on speed.

    python scripts/bench_collect.py --objects 20000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import boto3

from qworker.batch.collect import collect_batch
from qworker.batch.listing import split_points
from qworker.batch.manifest import Manifest, write_manifest
from qworker.batch.store import open_store
from qworker.config import WorkerSettings
from qworker.schema import batch_folder, result_key
from qworker.worker.sinks.s3 import collect as baseline_collect

_BODY = json.dumps({"id": "batch_req_x", "custom_id": "{cid}", "response": {
    "status_code": 200, "request_id": "req_x", "body": {"object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 300}}]}},
    "error": None})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def _fill(s3: Any, bucket: str, prefix: str, batch: str, n: int) -> list[str]:
    ids = [f"doc-{uuid.uuid4().hex[:12]}" for _ in range(n)]

    def put(cid: str) -> None:
        s3.put_object(Bucket=bucket, Key=result_key(prefix, batch, cid),
                      Body=_BODY.replace("{cid}", cid).encode())

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(put, ids))
    return ids


def _measure(endpoint: str, bucket: str, prefix: str, batch: str, ids: list[str],
             workers: int, listers: int) -> dict[str, float]:
    settings = WorkerSettings(s3_endpoint_url=endpoint)
    store = open_store(f"s3://{bucket}/{prefix}", settings, workers=workers)
    t0 = time.perf_counter()
    n_base = sum(1 for _ in baseline_collect(f"s3://{bucket}/{prefix}", batch, settings))
    base_s = time.perf_counter() - t0
    sink = io.BytesIO()
    t0 = time.perf_counter()
    stats = collect_batch(store, batch, sink, sink, progress=False, workers=workers)
    ours_s = time.perf_counter() - t0
    # the old collect also returns the manifest object (it skips only sub-folders)
    assert stats.results == len(ids) and not stats.missing and n_base == len(ids) + 1
    folder = batch_folder(prefix, batch)
    keys = [result_key(prefix, batch, cid) for cid in ids]
    t0 = time.perf_counter()
    one = store.list_names(folder)
    list1_s = time.perf_counter() - t0
    cuts = split_points(keys, listers)
    t0 = time.perf_counter()
    ranged = store.list_names(folder, cuts)
    listn_s = time.perf_counter() - t0
    assert ranged == one
    n = len(ids)
    return {
        "baseline_objects_per_s": round(n / base_s, 1),
        "collect_objects_per_s": round(n / ours_s, 1),
        "collect_vs_baseline": round(base_s / ours_s, 2),
        "list_keys_per_s_1_lister": round(len(one) / list1_s, 1),
        "list_keys_per_s_ranged": round(len(ranged) / listn_s, 1),
        "ranged_listers": len(cuts) + 1,
        "million_results_collect_minutes": round(1e6 / (n / ours_s) / 60, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    from qworker.testing.faultproxy import FaultProxy

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=64, help="GET threads of collect")
    parser.add_argument("--listers", type=int, default=16, help="ranged listers (at most)")
    parser.add_argument("--latency", type=float, default=0.02,
                        help="seconds the proxy adds per request (0 skips that run)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    proc, url = _start_moto()
    proxy = None
    try:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          config=boto3.session.Config(max_pool_connections=64))
        bucket, prefix, batch = "bench", "out", "night"
        s3.create_bucket(Bucket=bucket)
        t0 = time.perf_counter()
        ids = _fill(s3, bucket, prefix, batch, args.objects)
        fill_s = time.perf_counter() - t0
        store = open_store(f"s3://{bucket}/{prefix}", WorkerSettings(s3_endpoint_url=url))
        write_manifest(store, Manifest(batch, len(ids), "bench.jsonl", int(time.time()), ids))
        runs = {"direct": _measure(url, bucket, prefix, batch, ids, args.workers, args.listers)}
        if args.latency > 0:
            proxy = FaultProxy(url, latency=args.latency)
            proxied = proxy.start()
            runs[f"latency_{int(args.latency * 1000)}ms"] = _measure(
                proxied, bucket, prefix, batch, ids, args.workers, args.listers)
    finally:
        if proxy is not None:
            proxy.stop()
        proc.terminate()
        proc.wait(10)
    row: dict[str, Any] = {"bench": "collect", "objects": len(ids), "workers": args.workers,
                           "fill_objects_per_s": round(len(ids) / fill_s, 1),
                           "cpus": os.cpu_count(), **runs}
    print(f"{'run':<16}{'what':<30}{'objects/s':>12}")
    for name, r in runs.items():
        print(f"{name:<16}{'baseline collect (8 threads)':<30}{r['baseline_objects_per_s']:>12}")
        print(f"{'':<16}{'qworker.batch collect':<30}{r['collect_objects_per_s']:>12}"
              f"   x{r['collect_vs_baseline']} vs baseline")
        print(f"{'':<16}{'listing, 1 lister':<30}{r['list_keys_per_s_1_lister']:>12}")
        print(f"{'':<16}{'listing, ' + str(r['ranged_listers']) + ' ranged':<30}"
              f"{r['list_keys_per_s_ranged']:>12}")
    print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
