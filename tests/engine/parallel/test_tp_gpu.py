"""Tensor parallelism on 2+ GPUs (NCCL): the decode CUDA graphs capture the all-reduces
and replay them exactly as eager steps run, overlapped steps broadcast the sampled ids
on the device, and two GPUs give one GPU's tokens. Skipped below 2 GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")


def _tokens(model_dir: Path, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    from qworker.engine.llm import LLM
    from qworker.engine.sampling_params import SamplingParams

    llm = LLM(str(model_dir), device="cuda", max_model_len=128, num_kv_blocks=256,
              max_num_seqs=8, **kwargs)
    try:
        assert llm.stats().cuda_graphs is (not kwargs.get("enforce_eager", False))
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


def test_captured_all_reduces_replay_like_eager_steps(tmp_path: Path) -> None:
    _two_gpus()
    from tests.engine.reference import random_prompts
    from tests.fixtures.models import make_tiny_model_dir

    # bf16, head size 64: the captured decode needs the tensor-core kernels' fixed plans
    model_dir = make_tiny_model_dir("llama", tmp_path / "m", head_dim=64)
    prompts = random_prompts(12, 3, 40, seed=11)
    eager = _tokens(model_dir, prompts, dtype="bfloat16", tensor_parallel_size=2,
                    enforce_eager=True)
    graphs = _tokens(model_dir, prompts, dtype="bfloat16", tensor_parallel_size=2)
    assert graphs == eager


def test_two_gpus_give_one_gpus_tokens_in_fp32(tmp_path: Path) -> None:
    _two_gpus()
    from tests.engine.reference import random_prompts
    from tests.fixtures.models import make_tiny_model_dir

    model_dir = make_tiny_model_dir("llama", tmp_path / "m")
    prompts = random_prompts(12, 3, 40, seed=12)
    one = _tokens(model_dir, prompts, dtype="float32", enforce_eager=True)
    two = _tokens(model_dir, prompts, dtype="float32", enforce_eager=True,
                  tensor_parallel_size=2)
    assert two == one
