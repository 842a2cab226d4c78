"""Beam search on the paged engine: parity with transformers, block sharing, validation."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.engine.beam_search import BeamSearch, beam_search
from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from qworker.errors import ContextLengthExceededError, EngineError, InvalidRequestError

# Three lengths: under one block, across a block of 8, across two blocks of 8 / one of 16.
PROMPTS = [[5, 17, 99, 3, 250, 8, 7, 300, 12, 41, 77], [9, 8], list(range(20, 40))]
MAX_NEW = 10


@functools.lru_cache(maxsize=8)
def _hf_model(path: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@functools.lru_cache(maxsize=128)
def _hf_beams(path: str, prompt: tuple[int, ...], k: int, max_new: int, eos: int | None = None,
              length_penalty: float = 1.0, early_stopping: bool | str = False
              ) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search of one prompt: every returned beam (EOS kept) and its score."""
    import transformers

    config = transformers.GenerationConfig(
        num_beams=k, do_sample=False, num_return_sequences=k, max_new_tokens=max_new,
        early_stopping=early_stopping, length_penalty=length_penalty, eos_token_id=eos,
        pad_token_id=0, bos_token_id=1, return_dict_in_generate=True, output_scores=True,
    )
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = _hf_model(path).generate(ids, attention_mask=torch.ones_like(ids),
                                       generation_config=config)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]  # padding follows a finished beam
        beams.append(row)
    return beams, out.sequences_scores.tolist()


def _llm(path: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(str(path), dtype="float32", device="cpu", **kwargs)


def _assert_matches_hf(outs: list[Any], path: Path, prompts: list[list[int]], k: int,
                       max_new: int, eos: int | None = None, length_penalty: float = 1.0,
                       early_stopping: bool | str = False) -> None:
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        beams, scores = _hf_beams(str(path), tuple(prompt), k, max_new, eos, length_penalty,
                                  early_stopping)
        assert out.prompt_token_ids == prompt
        assert [c.token_ids for c in out.outputs] == beams, f"prompt {prompt}"
        assert [c.index for c in out.outputs] == list(range(k))
        for c, score in zip(out.outputs, scores, strict=True):
            ours = c.cumulative_logprob / len(c.token_ids) ** length_penalty
            assert ours == pytest.approx(score, rel=1e-4, abs=1e-4)
            ends_in_eos = eos is not None and c.token_ids[-1] == eos
            assert c.finish_reason == ("stop" if ends_in_eos else "length")


@pytest.mark.parametrize(
    ("fixture", "k", "block_size"),
    [
        ("tiny_llama_dir", 2, 8),
        ("tiny_llama_dir", 4, 16),
        ("tiny_qwen2_dir", 4, 8),
        ("tiny_opt_dir", 2, 16),
    ],
)
def test_every_beam_matches_transformers_with_eos_disabled(
    fixture: str, k: int, block_size: int, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    llm = _llm(path, block_size=block_size)
    outs = llm.beam_search(PROMPTS, beam_width=k, max_tokens=MAX_NEW, ignore_eos=True)
    _assert_matches_hf(outs, path, PROMPTS, k, MAX_NEW)
    assert all(c.text == "" for o in outs for c in o.outputs)  # no tokenizer in the dir
    assert llm.stats()["kv_blocks_used"] == 0


def test_parity_holds_with_chunked_prefill_and_requests_in_turns(tiny_llama_dir: Path) -> None:
    # 12 blocks of 8 hold the worst case of one request at a time (8-10 blocks), so the
    # three prompts run in turns; 8-token steps chunk the 11- and 20-token prompts.
    llm = _llm(tiny_llama_dir, block_size=8, num_kv_blocks=12, max_model_len=64,
               max_num_batched_tokens=8)
    search = BeamSearch(llm.engine, beam_width=4, max_tokens=MAX_NEW, ignore_eos=True)
    outs = search.run(PROMPTS)
    _assert_matches_hf(outs, tiny_llama_dir, PROMPTS, 4, MAX_NEW)
    assert search.peak_kv_blocks_used <= 12
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, block_size=8)
    first = llm.beam_search([PROMPTS[2]], beam_width=2, max_tokens=4, ignore_eos=True)
    again = llm.beam_search([PROMPTS[2]], beam_width=2, max_tokens=4, ignore_eos=True)
    assert again[0].num_cached_tokens == 16 and llm.stats()["prefix_cache_hits"] == 16
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in first[0].outputs]
    _assert_matches_hf(again, tiny_llama_dir, [PROMPTS[2]], 2, 4)


def test_max_model_len_caps_the_beams(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, block_size=8, max_model_len=26)
    outs = llm.beam_search([PROMPTS[2]], beam_width=2, max_tokens=MAX_NEW, ignore_eos=True)
    _assert_matches_hf(outs, tiny_llama_dir, [PROMPTS[2]], 2, 26 - len(PROMPTS[2]))
    assert all(len(c.token_ids) == 6 for c in outs[0].outputs)


def test_beam_width_one_is_greedy(tiny_qwen2_dir: Path) -> None:
    llm = _llm(tiny_qwen2_dir)
    beams = llm.beam_search(PROMPTS, beam_width=1, max_tokens=MAX_NEW, ignore_eos=True)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                  ignore_eos=True), use_tqdm=False)
    assert [b.outputs[0].token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]


@pytest.fixture(scope="module")
def eos_model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The tiny Llama with its EOS set to a token its best beam emits third."""
    best, _ = _hf_beams(str(tiny_llama_dir), tuple(PROMPTS[1]), 2, MAX_NEW)
    eos = best[0][2]
    path = tmp_path_factory.mktemp("tiny_llama_eos")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path, eos


@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(0.5, False), (2.0, False),
                                                                 (0.5, True)])
def test_eos_and_length_penalty_rank_hypotheses_like_transformers(
    eos_model: tuple[Path, int], length_penalty: float, early_stopping: bool
) -> None:
    path, eos = eos_model
    llm = _llm(path, block_size=8)
    outs = beam_search(llm, PROMPTS, beam_width=2, max_tokens=MAX_NEW,
                       length_penalty=length_penalty, early_stopping=early_stopping)
    _assert_matches_hf(outs, path, PROMPTS, 2, MAX_NEW, eos, length_penalty, early_stopping)
    stops = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
    if length_penalty < 1:  # short EOS hypotheses win; a penalty of 2 ranks them out
        assert stops
    assert llm.stats()["kv_blocks_used"] == 0


def test_ignore_eos_runs_past_the_eos_token(eos_model: tuple[Path, int]) -> None:
    path, eos = eos_model
    outs = _llm(path).beam_search([PROMPTS[1]], beam_width=2, max_tokens=MAX_NEW,
                                  ignore_eos=True)
    assert all(len(c.token_ids) == MAX_NEW and c.finish_reason == "length"
               for c in outs[0].outputs)
    assert eos in outs[0].outputs[0].token_ids


def test_beams_share_prompt_blocks_copy_on_write_and_free_everything(
    tiny_llama_dir: Path,
) -> None:
    llm = _llm(tiny_llama_dir, block_size=8)
    engine = llm.engine
    copies: list[tuple[int, int]] = []
    run_copies = engine.runner.copy_blocks

    def record(pairs: list[tuple[int, int]]) -> None:
        copies.extend(pairs)
        run_copies(pairs)

    engine.runner.copy_blocks = record  # type: ignore[method-assign]
    prompt = list(range(100, 141))  # 41 tokens: 5 full blocks and a shared partial one
    search = BeamSearch(engine, beam_width=4, max_tokens=8, ignore_eos=True)
    out = search.run([prompt])
    separate = 4 * engine.kv.blocks_for(len(prompt) + 8 - 1)  # 24: four private copies
    assert search.peak_kv_blocks_unshared == separate
    assert search.peak_kv_blocks_used <= 5 + 4 * 2 < separate / 1.5
    assert copies, "forked beams wrote into their shared partial block without a copy"
    assert len(out[0].outputs) == 4
    assert llm.stats()["kv_blocks_used"] == 0
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv.tables and not engine.kv.pending_copies
    # The engine still serves ordinary requests afterwards, with the right greedy tokens.
    greedy = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True), use_tqdm=False)
    best = llm.beam_search([PROMPTS[0]], beam_width=1, max_tokens=4, ignore_eos=True)
    assert greedy[0].outputs[0].token_ids == best[0].outputs[0].token_ids


class _CheckedBeamSearch(BeamSearch):
    """Checks the pool's reference counts against the live block tables before each forward."""

    checks = 0

    def _forward(self, seqs: list[Any], num_new: list[int]) -> torch.Tensor | None:
        kv = self.kv
        refs: dict[int, int] = {}
        for table in kv.tables.values():
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in kv.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), block
        assert kv.pool.num_used_blocks == len(refs)
        for seq in seqs:  # every slot the forward writes is private to its sequence
            table = kv.tables[seq.seq_id]
            assert len(table) * kv.block_size >= seq.num_computed_tokens + 1
            assert table[seq.num_computed_tokens // kv.block_size].ref_cnt == 1
        self.checks += 1
        return super()._forward(seqs, num_new)


def test_block_accounting_stays_exact_through_forks_drops_and_eos(
    eos_model: tuple[Path, int],
) -> None:
    path, _ = eos_model
    llm = _llm(path, block_size=8, num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=8)
    search = _CheckedBeamSearch(llm.engine, beam_width=3, max_tokens=12, length_penalty=0.5)
    outs = search.run(PROMPTS)
    assert search.checks >= 12 and all(len(o.outputs) == 3 for o in outs)
    assert llm.engine.kv.pool.num_used_blocks == 0 and not llm.engine.kv.tables


def test_text_is_detokenized_without_the_eos(tiny_chat_model_dir: Path) -> None:
    llm = _llm(tiny_chat_model_dir, block_size=16)
    out = llm.beam_search("Hello there", beam_width=2, max_tokens=4, ignore_eos=True)[0]
    tokenizer = llm.tokenizer
    assert out.prompt == "Hello there"
    for c in out.outputs:
        full = tokenizer.decode(out.prompt_token_ids + c.token_ids, skip_special_tokens=True)
        assert full.endswith(c.text) and c.text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": True}, "beam_width"),
        ({"beam_width": 2.0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"length_penalty": math.nan}, "length_penalty"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_arguments_raise_naming_the_field(
    tiny_llama_dir: Path, kwargs: dict[str, Any], field: str
) -> None:
    llm = _llm(tiny_llama_dir)
    with pytest.raises(InvalidRequestError, match=field):
        beam_search(llm, [PROMPTS[0]], **kwargs)


def test_bad_prompts_raise_before_anything_runs(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.beam_search([PROMPTS[0], []])
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.beam_search([[1, 2, 100000]])
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.beam_search("no tokenizer here")
    with pytest.raises(ContextLengthExceededError, match="max_model_len"):
        llm.beam_search([list(range(3, 35))])
    with pytest.raises(InvalidRequestError, match="prompts"):
        llm.beam_search(42)  # type: ignore[arg-type]
    assert llm.beam_search([]) == []
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_pool_too_small_for_one_request_is_refused_naming_beam_width(
    tiny_llama_dir: Path,
) -> None:
    llm = _llm(tiny_llama_dir, block_size=8, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ContextLengthExceededError, match="beam_width"):
        llm.beam_search([PROMPTS[2]], beam_width=4, max_tokens=30)


def test_a_busy_engine_is_refused(tiny_llama_dir: Path) -> None:
    llm = _llm(tiny_llama_dir)
    llm.engine.add_request("other", PROMPTS[0], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="idle"):
        llm.beam_search([PROMPTS[1]], beam_width=2, max_tokens=4)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.stats()["kv_blocks_used"] == 0
