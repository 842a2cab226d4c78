"""A tensor-parallel rank killed mid-step, through the worker: exit 70, every unfinished
job handed back to the source (none gets an error record), no rank left running; a
worker started afterwards serves exactly the rest."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_settings")
pytest.importorskip("orjson")

from qworker.config import WorkerSettings
from qworker.worker.app import serve
from tests.engine.reference import random_prompts
from tests.worker.jobs import completion_job, read_results, write_spool

N_JOBS = 12


def _ranks() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("qworker-tp-rank")]


def _settings(tmp_path: Path, model: Path, **kw: Any) -> WorkerSettings:
    base = {"source": f"file://{tmp_path}/jobs.jsonl", "sink": f"file://{tmp_path}/out",
            "model": str(model), "device": "cpu", "dtype": "float32", "num_kv_blocks": 64,
            "max_model_len": 128, "max_num_seqs": 4, "metrics_port": 0,
            "spot_metadata_url": "", "tensor_parallel_timeout": 60}
    return WorkerSettings(**{**base, **kw})


def test_a_rank_killed_mid_step_exits_70_and_hands_every_unfinished_job_back(
        tmp_path: Path, tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    jobs = [completion_job(f"job-{i}", prompt=p, max_tokens=32, ignore_eos=True)
            for i, p in enumerate(random_prompts(N_JOBS, 4, 20, seed=11))]
    write_spool(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"

    async def run_and_kill() -> tuple[int, list[Any]]:
        task = asyncio.create_task(serve(_settings(tmp_path, tiny_llama_dir,
                                                   tensor_parallel_size=2)))
        while len(read_results(out)) < 2:  # steps are running
            assert not task.done(), "the worker stopped before serving"
            await asyncio.sleep(0.02)
        ranks = _ranks()
        assert len(ranks) == 1
        os.kill(ranks[0].pid or 0, signal.SIGKILL)
        code, _ = await asyncio.wait_for(task, 60)
        return code, ranks

    with caplog.at_level(logging.ERROR):
        code, ranks = asyncio.run(run_and_kill())
    assert code == 70
    assert not ranks[0].is_alive() and _ranks() == []  # reaped, nothing left running
    assert "tensor-parallel rank 1" in caplog.text and "killed by signal 9" in caplog.text
    served = read_results(out)
    assert 2 <= len(served) < N_JOBS  # it died mid-run
    assert all(r["response"]["status_code"] == 200 for r in served.values())

    code, _ = asyncio.run(serve(_settings(tmp_path, tiny_llama_dir, until_idle=1.0)))
    assert code == 0
    final = read_results(out)  # asserts one result per custom_id
    assert set(final) == {j["custom_id"] for j in jobs}
    assert all(final[k] == v for k, v in served.items())


def test_a_hung_rank_fails_the_engine_at_the_collective_timeout_and_close_reaps_it(
        tiny_llama_dir: Path) -> None:
    from qworker import LLM, SamplingParams
    from qworker.errors import EngineDeadError

    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=32,
              max_model_len=128, tensor_parallel_size=2, tensor_parallel_timeout=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    try:
        assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        (rank,) = _ranks()
        os.kill(rank.pid or 0, signal.SIGSTOP)  # alive, but answers no collective
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="collective failed"):
            llm.generate([[8, 9, 10]], params, use_tqdm=False)
        assert 3 < time.monotonic() - started < 60
        with pytest.raises(EngineDeadError):  # no later step runs on a broken group
            llm.generate([[8, 9, 10]], params, use_tqdm=False)
    finally:
        llm.close()
    assert not rank.is_alive() and _ranks() == []
