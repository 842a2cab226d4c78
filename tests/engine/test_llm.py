"""Greedy parity with transformers, token for token, whatever the engine's memory plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from tests.engine.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(path: Path, **kwargs: object) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(path), dtype="float32", device="cpu", **kwargs)


def _check_parity(llm: LLM, path: Path, prompts: list[list[int]], n_tokens: int = 8) -> None:
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, n_tokens)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
                "tiny_opt_dir"]
)
def test_greedy_matches_transformers_for_every_architecture(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    _check_parity(_engine(path), path, random_prompts(8, 1, 40, seed=1))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"block_size": 8}, id="block8"),
        pytest.param({"block_size": 32}, id="block32"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
        pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
    ],
)
def test_greedy_parity_holds_across_block_sizes_chunking_and_caching(
    tiny_llama_dir: Path, kwargs: dict[str, object]
) -> None:
    _check_parity(_engine(tiny_llama_dir, **kwargs), tiny_llama_dir,
                  random_prompts(10, 1, 60, seed=2))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_resume_with_identical_tokens(tiny_llama_dir: Path, mode: str) -> None:
    # 12 blocks of 8 = 96 slots for 8 sequences of ~30 tokens: preemption is unavoidable.
    llm = _engine(tiny_llama_dir, block_size=8, num_kv_blocks=12, max_model_len=96,
                  preemption_mode=mode, swap_space=1 << 20)
    _check_parity(llm, tiny_llama_dir, random_prompts(8, 12, 24, seed=3), n_tokens=10)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_outs"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_dir: Path) -> None:
    gguf = next(smollm2_dir.glob("*.gguf")).name
    from tests.fixtures.models import _smollm2_tokenizer_dir

    # The HF tokenizer files cached by the fixtures skip a slow GGUF tokenizer parse.
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", max_model_len=128,
              num_kv_blocks=32, tokenizer=str(_smollm2_tokenizer_dir(smollm2_dir)))
    prompts = [llm.tokenizer.encode(t) for t in
               ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(smollm2_dir, prompt, 4, gguf_file=gguf)
        assert out.outputs[0].text
