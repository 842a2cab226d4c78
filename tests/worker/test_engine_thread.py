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


async def _start_spread(engine: object, slow_submit_s: float, batched: bool) -> float:
    """Submit 6 requests (each ``slow_submit_s`` apart) to a running engine thread; the
    seconds between the first and the last of them getting scheduled (microseconds when
    they start in one step, at least ``slow_submit_s`` when they trickle in)."""
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
    starts = [out.metrics.first_scheduled_time for out in done]
    assert None not in starts
    return max(starts) - min(starts)  # type: ignore[type-var, operator]


def test_a_batch_of_submits_starts_in_one_echo_engine_step() -> None:
    engine = EchoEngine(steps=3)
    assert asyncio.run(_start_spread(engine, 0.02, batched=True)) < 0.01


def test_without_a_batch_the_first_submit_can_start_alone() -> None:
    # The behaviour the batch prevents: the thread wakes on the first job and steps.
    engine = EchoEngine(steps=3)
    assert asyncio.run(_start_spread(engine, 0.1, batched=False)) >= 0.1


@pytest.mark.slow
def test_a_batch_of_submits_is_prefilled_together_by_the_real_engine(tiny_llama_dir: Path
                                                                     ) -> None:
    from qworker.engine.config import EngineConfig
    from qworker.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=64,
                                 max_model_len=64))
    assert asyncio.run(_start_spread(engine, 0.02, batched=True)) < 0.01
