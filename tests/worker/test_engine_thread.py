"""Jobs submitted together reach the engine in one step, even while it is stepping."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.worker.echo_engine import EchoEngine
from qworker.worker.engine_thread import EngineThread


async def _first_steps(engine: object, slow_submit_s: float, batched: bool) -> set[float]:
    """Submit 6 requests (each ``slow_submit_s`` apart) to a running engine thread; the
    distinct first-scheduled times of their outputs (one per engine step they began in)."""
    loop = asyncio.get_running_loop()
    done: list[RequestOutput] = []
    finished = asyncio.Event()

    def on_outputs(outs: list[RequestOutput]) -> None:
        done.extend(outs)
        if len(done) == 6:
            finished.set()

    thread = EngineThread(engine, loop, on_outputs, lambda exc: None)  # type: ignore[arg-type]
    thread.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        with thread.batch() if batched else contextlib.nullcontext():
            for i in range(6):
                thread.submit(f"r{i}", None, [5, 6, 7], params)
                time.sleep(slow_submit_s)  # admission work between submits, on the loop
        await asyncio.wait_for(finished.wait(), 30)
    finally:
        thread.stop()
    return {out.metrics.first_scheduled_time for out in done}


def test_a_batch_of_submits_starts_in_one_echo_engine_step() -> None:
    engine = EchoEngine(steps=3)
    starts = asyncio.run(_first_steps(engine, 0.02, batched=True))
    assert len(starts) == 1


def test_without_a_batch_the_first_submit_can_start_alone() -> None:
    # The behaviour the batch prevents: the thread wakes on the first job and steps.
    engine = EchoEngine(steps=3)
    starts = asyncio.run(_first_steps(engine, 0.1, batched=False))
    assert len(starts) > 1


@pytest.mark.slow
def test_a_batch_of_submits_is_prefilled_together_by_the_real_engine(tiny_llama_dir: Path
                                                                     ) -> None:
    from qworker.engine.config import EngineConfig
    from qworker.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64,
                                 max_model_len=64))
    starts = asyncio.run(_first_steps(engine, 0.02, batched=True))
    assert len(starts) == 1
