"""Sampler: greedy parity with argmax, seeded reproducibility, warpers, logprobs."""

from __future__ import annotations

import torch

from qworker.engine.sampler import Sampler
from qworker.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_seq

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def test_greedy_is_torch_argmax_including_ties() -> None:
    logits = _logits(3)
    logits[1, 4] = logits[1, 9] = logits[1].max() + 1  # tie: argmax takes the first
    seqs = [make_seq([1], SamplingParams(temperature=0)) for _ in range(3)]
    out = Sampler().sample(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[1] == 4
    assert out.logprobs == [None, None, None]


def test_seeded_draw_does_not_depend_on_batch_companions() -> None:
    logits = _logits(4)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler().sample(logits[2:3], [make_seq([1], params)]).token_ids[0]
    mixed = [make_seq([1], SamplingParams(temperature=0.7)) for _ in range(4)]
    mixed[2] = make_seq([1], params)
    batched = Sampler().sample(logits, mixed).token_ids[2]
    assert alone == batched


def test_seeded_draws_differ_across_positions_and_completion_indices() -> None:
    logits = torch.zeros(1, V)  # uniform: any repeat would be a coincidence
    params = SamplingParams(temperature=1.0, seed=5)
    sampler = Sampler()
    seq = make_seq([1], params)
    draws = {sampler.sample(logits, [seq], output_positions=[p]).token_ids[0] for p in range(20)}
    assert len(draws) > 5
    other = make_seq([1], params, index=1)
    firsts = [sampler.sample(logits, [s], output_positions=[0]).token_ids[0] for s in (seq, other)]
    again = sampler.sample(logits, [seq], output_positions=[0]).token_ids[0]
    assert again == firsts[0]


def test_draws_follow_the_softmax_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    counts = torch.zeros(V)
    sampler = Sampler()
    for s in range(2000):
        seq = make_seq([1], SamplingParams(temperature=1.0, seed=s))
        counts[sampler.sample(logits, [seq]).token_ids[0]] += 1
    freq = counts[:3] / 2000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.05)
    assert counts[3:].sum() == 0


def test_top_k_one_top_p_tiny_and_min_p_one_all_reduce_to_greedy() -> None:
    logits = _logits(6, seed=3)
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=1),
                   SamplingParams(min_p=1.0, seed=1)):
        seqs = [make_seq([1], params) for _ in range(6)]
        assert Sampler().sample(logits, seqs).token_ids == greedy


def test_top_k_draws_only_among_the_k_best() -> None:
    logits = _logits(1, seed=4)
    best = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler()
    for s in range(100):
        seq = make_seq([1], SamplingParams(temperature=2.0, top_k=3, seed=s))
        assert sampler.sample(logits, [seq]).token_ids[0] in best


def test_repetition_penalty_matches_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _logits(1, seed=5)
    history = [3, 7, 7, 11, 20]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), logits.clone())
    seq = make_seq(history, SamplingParams(temperature=0, repetition_penalty=1.7))
    assert Sampler().sample(logits, [seq]).token_ids == expected.argmax(-1).tolist()


def test_logprobs_are_raw_log_softmax_top_k_plus_the_chosen_token() -> None:
    logits = _logits(2, seed=6)
    ref = torch.log_softmax(logits, -1)
    seqs = [make_seq([1], SamplingParams(temperature=1.0, seed=9, logprobs=2)),
            make_seq([1], SamplingParams(temperature=0))]
    out = Sampler().sample(logits, seqs)
    top = out.top_logprobs[0]
    chosen = out.token_ids[0]
    assert set(ref[0].topk(2).indices.tolist()) <= set(top)
    assert len(top) in (2, 3) and chosen in top
    for tok, lp in top.items():
        assert abs(lp - ref[0, tok].item()) < 1e-6
    assert abs(out.logprobs[0] - ref[0, chosen].item()) < 1e-6
    assert out.top_logprobs[1] is None
