"""Automatic prefix caching through the engine: hits, identical outputs, no corruption."""

from __future__ import annotations

from pathlib import Path

from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from tests.engine.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _shared_prefix_prompts(count: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, 48, 48, seed=100)[0]  # three 16-token blocks
    return [prefix + tail for tail in random_prompts(count, 1, 10, seed=seed)]


def _llm(path: Path, **kwargs: object) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=128, block_size=16,
               **kwargs)


def test_second_pass_over_a_shared_prefix_hits_the_cache_with_identical_outputs(
    tiny_llama_dir: Path,
) -> None:
    prompts = _shared_prefix_prompts(4, seed=1)
    on, off = _llm(tiny_llama_dir), _llm(tiny_llama_dir, enable_prefix_caching=False)
    first = on.generate(prompts, GREEDY, use_tqdm=False)
    hits_after_first = on.stats()["prefix_cache_hits"]
    second = on.generate(prompts, GREEDY, use_tqdm=False)
    stats = on.stats()
    assert stats["prefix_cache_hits"] - hits_after_first >= len(prompts) * 48
    assert stats["prefix_cache_queries"] >= 2 * sum(len(p) for p in prompts)
    assert all(o.num_cached_tokens >= 48 for o in second)
    reference = off.generate(prompts, GREEDY, use_tqdm=False)
    assert off.stats()["prefix_cache_hits"] == 0
    tokens = [[o.outputs[0].token_ids for o in outs] for outs in (first, second, reference)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert tokens[0][0] == hf_greedy(tiny_llama_dir, prompts[0], 6)


def test_eviction_under_heavy_churn_never_corrupts_a_cached_block(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, num_kv_blocks=10)
    shared = _shared_prefix_prompts(2, seed=2)
    before = [o.outputs[0].token_ids for o in llm.generate(shared, GREEDY, use_tqdm=False)]
    for round_ in range(2):  # distinct prompts that evict and reuse every block
        churn = random_prompts(5, 30, 60, seed=10 + round_)
        outs = llm.generate(churn, GREEDY, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == hf_greedy(tiny_llama_dir, churn[0], 6)
        again = llm.generate(shared, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == before
    assert llm.engine.kv.pool.num_evictions > 0
    assert llm.stats()["kv_blocks_used"] == 0
