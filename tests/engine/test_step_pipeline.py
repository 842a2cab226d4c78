"""Overlapped steps (async scheduling) give exactly the outputs of one step at a time:
transformers parity, preemption (recompute and swap), chunked prefill, n > 1, seeds,
logprobs, stop conditions, aborts and penalties (counted on the device, so they overlap
too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.step_pipeline import needs_host_history
from tests.engine.reference import hf_greedy, random_prompts


def _llm(path: Path, overlap: bool, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(str(path), dtype="float32", device="cpu", **kwargs)
    llm.engine.async_scheduling = overlap  # the CPU default is off; the logic is the same
    return llm


def _tokens(outs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize(
    ("fixture", "kwargs"),
    [
        pytest.param("tiny_llama_dir", {}, id="llama"),
        pytest.param("tiny_opt_dir", {}, id="opt"),
        pytest.param("tiny_llama_dir", {"block_size": 8, "max_num_batched_tokens": 16},
                     id="chunked-block8"),
        pytest.param("tiny_llama_dir", {"block_size": 8, "num_kv_blocks": 12,
                                        "max_model_len": 96}, id="preempt-recompute"),
        pytest.param("tiny_llama_dir", {"block_size": 8, "num_kv_blocks": 12,
                                        "max_model_len": 96, "preemption_mode": "swap",
                                        "swap_space": 1 << 20}, id="preempt-swap"),
    ],
)
def test_overlapped_greedy_matches_transformers(fixture: str, kwargs: dict[str, Any],
                                                request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    llm = _llm(path, True, **kwargs)
    prompts = random_prompts(8, 12, 24, seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 10)
    assert llm.engine.num_overlapped_steps > 5
    stats = llm.stats()
    assert stats.kv_blocks_used == 0 and not llm.engine.has_unfinished()
    if "num_kv_blocks" in kwargs:
        assert stats.num_preemptions > 0


def test_seeds_n_logprobs_stops_and_lengths_are_identical_with_and_without_overlap(
    tiny_llama_dir: Path,
) -> None:
    prompts = random_prompts(6, 5, 40, seed=4)
    expected = hf_greedy(tiny_llama_dir, prompts[0], 8)
    params = [
        SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, logprobs=3, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[expected[3]],
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # to max_model_len
        SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.8, max_tokens=8,
                       ignore_eos=True),  # device-side counts, with its token in flight
    ]
    prompts[2] = prompts[0]
    results = {}
    for overlap in (False, True):
        llm = _llm(tiny_llama_dir, overlap, max_model_len=64, num_kv_blocks=24, block_size=8)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = (_tokens(outs), [o.outputs[0].logprobs for o in outs],
                            [[c.finish_reason for c in o.outputs] for o in outs])
        assert llm.stats().kv_blocks_used == 0
    assert results[True] == results[False]
    tokens, _, reasons = results[True]
    assert tokens[2][0] == expected[:4] and reasons[2] == ["stop"]
    assert len(tokens[3][0]) == 64 - len(prompts[3]) and reasons[3] == ["length"]


def test_abort_while_a_step_is_in_flight(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                 max_model_len=128, num_kv_blocks=32))
    engine.async_scheduling = True
    engine.add_request("long", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    engine.add_request("short", [8, 9], SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True))
    outs: dict[str, Any] = {}
    for _ in range(3):
        for out in engine.step():
            outs[out.request_id] = out
    engine.abort("long")
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs["long"].outputs[0].finish_reason == "abort"
    assert 0 < len(outs["long"].outputs[0].token_ids) < 60
    assert outs["short"].outputs[0].token_ids == hf_greedy(tiny_llama_dir, [8, 9], 6)
    engine.step()  # the last launched step (its rows all finished) is drained
    assert engine.stats().kv_blocks_used == 0


def test_which_params_need_the_host_history() -> None:
    from qworker.engine.structured.params import StructuredOutputsParams

    assert not needs_host_history(SamplingParams(temperature=0.8, seed=1, logprobs=2))
    # penalties are counted on the device, tokens in flight included
    assert not needs_host_history(SamplingParams(repetition_penalty=1.2, presence_penalty=1,
                                                 frequency_penalty=0.5, min_tokens=3))
    # a grammar advances on the host token values
    assert needs_host_history(SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="a+")))


def test_blocks_completed_by_a_pending_token_are_cached_with_the_right_tokens(
    tiny_llama_dir: Path,
) -> None:
    # Turn 2's prompt is turn 1's prompt + answer: its leading blocks, including those
    # completed by tokens that were pending when their step launched, come from the cache.
    llm = _llm(tiny_llama_dir, True, block_size=8, num_kv_blocks=48)
    first = random_prompts(1, 13, 13, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)
    (out,) = llm.generate([first], params, use_tqdm=False)
    second = first + out.outputs[0].token_ids + [7, 8, 9]
    hits_before = llm.stats().prefix_cache_hits
    (again,) = llm.generate([second], params, use_tqdm=False)
    # 4 full blocks of 8: with overlap even the last answer token's KV was computed (by
    # the discarded step after it), so block 4 is complete and cached too
    assert llm.stats().prefix_cache_hits - hits_before == 32
    assert again.outputs[0].token_ids == hf_greedy(tiny_llama_dir, second, 19)
