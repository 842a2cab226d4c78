"""The model runner's decode step never makes the host wait for the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qworker.attention.select import select_backend
from qworker.engine.model_runner import ModelRunner
from qworker.engine.step_inputs import StepInput
from qworker.models.loader import load_model
from tests.engine.sync_guard import HostSyncError, no_host_sync


def _runner(model_dir: Path, device: str, backend: str = "auto",
            dtype: torch.dtype = torch.float32) -> ModelRunner:
    dev = torch.device(device)
    loaded = load_model(model_dir, dtype, dev)
    return ModelRunner(loaded.model, loaded.spec, dev, 16, 16, select_backend(backend, dev),
                       max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)


def _prefill_then_decode_steps(runner: ModelRunner) -> list[StepInput]:
    prompts = [[5, 6, 7], list(range(10, 30))]
    tables = [[0], [1, 2]]
    steps = [StepInput(prompts, [0, 0], tables, [1, 1], table_keys=[0, 1])]
    for i in range(3):
        steps.append(StepInput([[40 + i], [50 + i]], [3 + i, 20 + i], tables, [1, 1],
                               table_keys=[0, 1]))
    return steps


def test_guard_catches_host_reads_and_device_to_host_copies() -> None:
    t = torch.arange(4)
    with pytest.raises(HostSyncError), no_host_sync():
        int(t[1])
    with pytest.raises(HostSyncError), no_host_sync():
        t.tolist()
    meta_t = torch.empty(3, device="meta")
    with pytest.raises(HostSyncError), no_host_sync():
        meta_t.to("cpu")
    with pytest.raises(HostSyncError), no_host_sync(strict=True):
        (t > 1).nonzero()


def test_decode_step_on_cpu_reads_nothing_back(tiny_qwen2_dir: Path) -> None:
    runner = _runner(tiny_qwen2_dir, "cpu")
    steps = _prefill_then_decode_steps(runner)
    runner.execute(steps[0])
    runner.execute(steps[1])  # warm: buffers sized, RoPE tables in place
    with no_host_sync() as guard:
        logits = runner.execute(steps[2])
    assert logits is not None and logits.shape[0] == 2
    assert "aten.index_select.default" in guard.ops  # the guard saw the forward's ops


def test_the_reference_backend_would_fail_the_check(tiny_llama_dir: Path) -> None:
    # The per-sequence oracle reads lengths back; the check must notice.
    runner = _runner(tiny_llama_dir, "cpu", backend="torch")
    steps = _prefill_then_decode_steps(runner)
    runner.execute(steps[0])
    with pytest.raises(HostSyncError), no_host_sync():
        runner.execute(steps[1])


@pytest.mark.gpu
def test_decode_step_on_gpu_never_syncs(tmp_path: Path) -> None:
    from tests.fixtures.models import make_tiny_model_dir

    # head size 64 in bf16: the CUDA kernels' path (not the reference's fallback)
    model_dir = make_tiny_model_dir("llama", tmp_path / "m", head_dim=64)
    runner = _runner(model_dir, "cuda", dtype=torch.bfloat16)
    assert runner.backend.name == "cuda"
    steps = _prefill_then_decode_steps(runner)
    runner.execute(steps[0])
    runner.execute(steps[1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with no_host_sync(strict=True):
            logits = runner.execute(steps[2])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits is not None and logits.is_cuda
