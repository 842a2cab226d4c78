"""n > 1: siblings share the prompt's blocks, copy the shared tail block on write, and
seeded sampling is reproducible alone, batched and preempted."""

from __future__ import annotations

from pathlib import Path

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from tests.engine.reference import hf_greedy, hf_logits, random_prompts

PROMPT = random_prompts(1, 60, 60, seed=7)[0]  # 3 full blocks of 16 + 12 tokens shared


def _engine(path: Path, **kwargs: object) -> Engine:
    kwargs.setdefault("num_kv_blocks", 64)
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                               max_model_len=128, block_size=16, **kwargs))


def _run(engine: Engine) -> tuple[dict[str, object], int]:
    outs, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        peak = max(peak, engine.kv.pool.num_used_blocks)
    return outs, peak


def test_n4_shares_prompt_blocks_and_copy_on_write_keeps_each_sibling_exact(
    tiny_llama_dir: Path,
) -> None:
    engine = _engine(tiny_llama_dir)
    engine.add_request("par", PROMPT, SamplingParams(n=4, temperature=0, max_tokens=4,
                                                      ignore_eos=True))
    outs, peak = _run(engine)
    completions = outs["par"].outputs
    expected = hf_greedy(tiny_llama_dir, PROMPT, 4)
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert all(c.token_ids == expected for c in completions)
    # four private copies would take 4 * 4 = 16 blocks; sharing needs 3 + 4
    assert peak <= 7
    assert engine.stats()["kv_blocks_used"] == 0


def test_seeded_n4_is_reproducible_alone_batched_and_preempted(tiny_llama_dir: Path) -> None:
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=1234, max_tokens=8,
                            ignore_eos=True)
    results = []
    for kwargs, others in (({}, 0), ({}, 5), ({"num_kv_blocks": 9}, 3)):
        engine = _engine(tiny_llama_dir, **kwargs)
        for i, prompt in enumerate(random_prompts(others, 20, 50, seed=8)):
            engine.add_request(f"o{i}", prompt, SamplingParams(temperature=0.8, max_tokens=8,
                                                                ignore_eos=True))
        engine.add_request("par", PROMPT, params)
        outs, _ = _run(engine)
        results.append([c.token_ids for c in outs["par"].outputs])
        if kwargs:
            assert engine.stats()["num_preemptions"] > 0
    assert results[0] == results[1] == results[2]
    assert len({tuple(r) for r in results[0]}) > 1  # siblings draw different tokens


def test_seeded_request_is_reproducible_alone_batched_and_preempted(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=8, ignore_eos=True)
    prompt = random_prompts(1, 30, 30, seed=9)[0]
    results = []
    for kwargs, others in (({}, 0), ({}, 4), ({"num_kv_blocks": 8}, 4),
                           ({"num_kv_blocks": 8, "preemption_mode": "swap",
                             "swap_space": 1 << 20}, 4)):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
                  block_size=16, **{"num_kv_blocks": 64, **kwargs})
        prompts = [*random_prompts(others, 30, 50, seed=10), prompt]
        mixed = [SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True)] * others
        outs = llm.generate(prompts, [*mixed, params], use_tqdm=False)
        results.append(outs[-1].outputs[0].token_ids)
        if "num_kv_blocks" in kwargs:
            assert llm.stats()["num_preemptions"] > 0
    assert all(r == results[0] for r in results)


def test_logprobs_equal_log_softmax_of_transformers_logits(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128,
              num_kv_blocks=16)
    prompt = random_prompts(1, 12, 12, seed=11)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=5,
                                                    ignore_eos=True, logprobs=3),
                          use_tqdm=False)
    comp = out.outputs[0]
    ref = torch.log_softmax(hf_logits(tiny_llama_dir, prompt + comp.token_ids), dim=-1)
    total = 0.0
    for i, (token, lps) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert token in lps and len(lps) in (3, 4)
        assert set(row.topk(3).indices.tolist()) <= set(lps)
        for tok, lp in lps.items():
            assert abs(lp - row[tok].item()) < 1e-4
        total += row[token].item()
    assert abs(comp.cumulative_logprob - total) < 1e-3
