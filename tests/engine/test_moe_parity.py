"""MoE models through the whole engine: greedy tokens equal transformers' under chunked
prefill, preemption (recompute and swap) and prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest

from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from tests.engine.reference import hf_greedy, random_prompts

FIXTURES = ["tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir"]


def _check(llm: LLM, path: Path, prompts: list[list[int]], n_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, n_tokens)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_moe_greedy_matches_transformers_with_chunked_prefill(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=16)
    _check(llm, path, random_prompts(6, 1, 40, seed=31), 6)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_moe_sequences_resume_with_identical_tokens(
    tiny_qwen2_moe_dir: Path, mode: str
) -> None:
    llm = LLM(str(tiny_qwen2_moe_dir), dtype="float32", device="cpu", block_size=8,
              num_kv_blocks=12, max_model_len=96, preemption_mode=mode, swap_space=1 << 20)
    _check(llm, tiny_qwen2_moe_dir, random_prompts(8, 12, 24, seed=32), 10)
    assert llm.stats()["num_preemptions"] > 0


def test_moe_prefix_cache_hits_keep_the_tokens(tiny_mixtral_dir: Path) -> None:
    prefix = random_prompts(1, 32, 32, seed=33)[0]
    prompts = [prefix + tail for tail in random_prompts(3, 1, 8, seed=34)]
    llm = LLM(str(tiny_mixtral_dir), dtype="float32", device="cpu", num_kv_blocks=64,
              max_model_len=128, block_size=16)
    _check(llm, tiny_mixtral_dir, prompts, 5)
    hits = llm.stats()["prefix_cache_hits"]
    _check(llm, tiny_mixtral_dir, prompts, 5)
    assert llm.stats()["prefix_cache_hits"] - hits >= 3 * 32
