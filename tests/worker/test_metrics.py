"""/metrics as Prometheus scrapes it: engine names with model_name, latencies, info,
per-batch counters with a bounded number of series."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("pydantic_settings")

from prometheus_client.parser import text_string_to_metric_families

from qworker import __version__
from qworker.config import WorkerSettings
from qworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.metrics import WorkerMetrics
from qworker.worker.sinks.file import FileSink
from qworker.worker.sources.file import FileSource
from qworker.worker.worker import Worker
from tests.worker.jobs import chat_job, write_spool


class _Named(EchoEngine):
    model_name = "SmolLM2-135M-Instruct"


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_a_scrape_after_a_run_has_the_engine_worker_and_batch_metrics(tmp_path: Path) -> None:
    # room for the run's three batches: records are stored concurrently, so which batch
    # is "least recent" at an eviction depends on timing (eviction has its own test below)
    metrics = WorkerMetrics(max_batches=3)
    port = metrics.serve(0, host="127.0.0.1")
    lines = [chat_job(f"a{i}") | {"batch_id": "night-a"} for i in range(3)]
    lines += [chat_job("b0") | {"batch_id": "night-b"}, chat_job("bad", temperature=-1)]
    spool = write_spool(tmp_path / "jobs.jsonl", lines)
    settings = WorkerSettings(source=f"file://{spool}", sink=f"file://{tmp_path}/out",
                              model="echo://", until_idle=0.3, metrics_port=0,
                              spot_metadata_url="")

    async def main() -> None:
        worker = Worker(settings, _Named(steps=3), FileSource(spool), FileSink(tmp_path / "out"),
                        metrics=metrics)
        await asyncio.wait_for(worker.run(), 30)

    try:
        asyncio.run(main())
        got = _scrape(port)
    finally:
        metrics.close()
    model = {"model_name": "SmolLM2-135M-Instruct"}
    for name in ("qworker_num_requests_running", "qworker_kv_cache_usage_perc",
                 "qworker_prompt_tokens_total", "qworker_generation_tokens_total",
                 "qworker_prefix_cache_queries_total", "qworker_prefix_cache_hits_total",
                 "qworker_time_to_first_token_seconds_count",
                 "qworker_e2e_request_latency_seconds_count",
                 "qworker_request_queue_time_seconds_count",
                 "qworker_inter_token_latency_seconds_count"):
        assert [labels for labels, _ in got[name]] == [model], name
    assert got["qworker_e2e_request_latency_seconds_count"][0][1] == 4.0
    assert got["qworker_inter_token_latency_seconds_count"][0][1] == 4.0
    assert got["qworker_info"] == [({"version": __version__, **model}, 1.0)]
    batches = {(lab["batch_id"], lab["status"]): v
               for lab, v in got["qworker_batch_jobs_completed_total"]}
    everything = {("night-a", "success"): 3.0, ("night-b", "success"): 1.0,
                  ("default", "invalid_request"): 1.0}
    assert batches == everything


def test_per_batch_series_are_bounded_to_the_most_recent_batches() -> None:
    metrics = WorkerMetrics(max_batches=3)
    for i in range(1000):
        metrics.job_completed("success", f"batch-{i}")
    metrics.job_completed("invalid_request", "batch-998")
    metrics.job_completed("success", "batch-5")  # comes back: evicts the oldest
    text = metrics.exposition().decode()
    series = [x for x in text.splitlines() if x.startswith("qworker_batch_jobs_completed_total")]
    assert sorted(series) == sorted([
        'qworker_batch_jobs_completed_total{batch_id="batch-998",status="success"} 1.0',
        'qworker_batch_jobs_completed_total{batch_id="batch-998",status="invalid_request"} 1.0',
        'qworker_batch_jobs_completed_total{batch_id="batch-999",status="success"} 1.0',
        'qworker_batch_jobs_completed_total{batch_id="batch-5",status="success"} 1.0',
    ])
    assert 'qworker_jobs_completed_total{status="success"} 1001.0' in text


def test_inter_token_and_queue_time_come_from_the_request_timestamps() -> None:
    metrics = WorkerMetrics()
    metrics.set_model("m")
    out = RequestOutput("r", "p", [1], [CompletionOutput(0, "abcde", [1, 2, 3, 4, 5])], True,
                        RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5,
                                       first_token_time=101.0, finished_time=103.0))
    metrics.observe_output(out)
    text = metrics.exposition().decode()
    assert 'qworker_inter_token_latency_seconds_sum{model_name="m"} 0.5' in text  # 2 s / 4
    assert 'qworker_request_queue_time_seconds_sum{model_name="m"} 0.5' in text
    assert 'qworker_time_to_first_token_seconds_sum{model_name="m"} 1.0' in text


def test_every_metric_the_docs_name_is_exported() -> None:
    """docs/formats.md "Metrics" is the contract: each name it lists is a family here."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "formats.md").read_text()
    section = text[text.index("## Metrics"):]
    documented = set(re.findall(r"`(qworker_[a-z0-9_]+)", section))
    metrics = WorkerMetrics()
    metrics.set_model("m")
    exported = set()
    for family in metrics.registry.collect():
        exported.add(family.name)
        exported.update(sample.name for sample in family.samples)
        if family.type == "counter":
            exported.add(f"{family.name}_total")
    assert len(documented) >= 25
    assert documented <= exported, sorted(documented - exported)


def test_kernel_paths_and_selftest_state_are_exported_and_follow_changes() -> None:
    from qworker.engine.stats import EngineStats

    metrics = WorkerMetrics()
    metrics.set_model("m")
    paths = {"decode": "legacy", "prefill": "tensor_core", "cache_write": "cuda"}
    metrics.update_engine(EngineStats(kernel_selftest="fell_back", kernel_paths=paths))
    text = metrics.exposition().decode()
    assert 'qworker_kernel_path{component="decode",model_name="m",path="legacy"} 1.0' in text
    assert 'qworker_kernel_selftest{model_name="m",state="fell_back"} 1.0' in text
    metrics.update_engine(EngineStats(kernel_selftest="passed",
                                      kernel_paths={**paths, "decode": "tensor_core"}))
    text = metrics.exposition().decode()
    assert 'path="legacy"' not in text and 'state="fell_back"' not in text
    assert 'qworker_kernel_path{component="decode",model_name="m",path="tensor_core"} 1.0' in text
