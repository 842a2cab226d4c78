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


# ---- Gemma 2 / 3 and Phi-3 (tests/fixtures/models.py: windows shorter than the prompts,
# soft-caps that change the logits, longrope switching at 64 tokens)

GEMMA = ["tiny_gemma2_dir", "tiny_gemma3_dir"]

MEMORY_PLANS = [
    pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
    pytest.param({"block_size": 8, "num_kv_blocks": 14, "max_model_len": 96}, id="recompute"),
    pytest.param({"block_size": 8, "num_kv_blocks": 14, "max_model_len": 96,
                  "preemption_mode": "swap", "swap_space": 1 << 20}, id="swap"),
]


@pytest.mark.parametrize("fixture", GEMMA)
def test_gemma_greedy_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    _check_parity(_engine(path), path, random_prompts(6, 1, 40, seed=1))


@pytest.mark.parametrize("kwargs", MEMORY_PLANS)
@pytest.mark.parametrize("fixture", GEMMA)
def test_gemma_greedy_parity_under_chunking_and_preemption(
    fixture: str, kwargs: dict[str, object], request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    llm = _engine(path, **kwargs)
    _check_parity(llm, path, random_prompts(6, 12, 30, seed=4), n_tokens=10)
    if "num_kv_blocks" in kwargs:  # 14 blocks of 8 for 6 sequences of up to 40 tokens
        assert llm.stats()["num_preemptions"] > 0


def _shared_prefix(count: int, prefix_len: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, prefix_len, prefix_len, seed=100)[0]
    return [prefix + tail for tail in random_prompts(count, 1, 10, seed=seed)]


@pytest.mark.parametrize("fixture", [*GEMMA, "tiny_phi3_dir"])
def test_prefix_cache_hits_keep_greedy_parity(fixture: str, request: pytest.FixtureRequest
                                              ) -> None:
    # Phi-3 within its original length (max_model_len 64: short factors, as transformers)
    path = request.getfixturevalue(fixture)
    max_len = 64 if fixture == "tiny_phi3_dir" else 128
    llm = _engine(path, block_size=16, max_model_len=max_len)
    prompts = _shared_prefix(3, 32, seed=5)  # two full blocks shared, past every window
    _check_parity(llm, path, prompts, n_tokens=6)
    hits = llm.stats()["prefix_cache_hits"]
    _check_parity(llm, path, prompts, n_tokens=6)
    assert llm.stats()["prefix_cache_hits"] - hits >= 3 * 32


@pytest.mark.parametrize("kwargs", MEMORY_PLANS[:2])
def test_phi3_short_context_matches_transformers(tiny_phi3_dir: Path,
                                                 kwargs: dict[str, object]) -> None:
    # max_model_len within original_max_position_embeddings (64): short factors, which is
    # what transformers uses while a sequence stays within 64 tokens
    kwargs = {**kwargs, "max_model_len": 64}
    _check_parity(_engine(tiny_phi3_dir, **kwargs), tiny_phi3_dir,
                  random_prompts(6, 12, 40, seed=6), n_tokens=10)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-prefill"),
        pytest.param({"block_size": 8, "num_kv_blocks": 33}, id="recompute"),
    ],
)
def test_phi3_long_context_past_the_original_length_matches_transformers(
    tiny_phi3_dir: Path, kwargs: dict[str, object]
) -> None:
    # max_model_len 256 > 64: long factors for every position; prompts past 64 tokens make
    # transformers use them too (its prefill and every decode see positions > 64)
    llm = _engine(tiny_phi3_dir, max_model_len=256, **kwargs)
    _check_parity(llm, tiny_phi3_dir, random_prompts(6, 66, 90, seed=7), n_tokens=10)
    if "num_kv_blocks" in kwargs:
        assert llm.stats()["num_preemptions"] > 0


def test_phi3_sequence_crossing_the_original_length_uses_the_long_factors_throughout(
    tiny_phi3_dir: Path,
) -> None:
    # A 50-token prompt generating 30 tokens crosses 64 mid-generation. transformers'
    # generate() would rotate the first 64 positions with the short factors and the rest
    # with the long ones (its cache mixes both); the engine decided by max_model_len
    # (256 > 64) and uses the long factors from the first token (docs/models.md). So the
    # reference is transformers' one forward over the whole final sequence (80 tokens:
    # long factors everywhere), teacher-forced.
    from tests.engine.reference import hf_logits

    prompt = random_prompts(1, 50, 50, seed=8)[0]
    llm = _engine(tiny_phi3_dir, max_model_len=256)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    logits = hf_logits(tiny_phi3_dir, prompt + out[:-1])[len(prompt) - 1:]
    for i, token in enumerate(out):
        best = logits[i].max()
        assert token == int(logits[i].argmax()) or float(best - logits[i, token]) < 1e-4, i
