"""Sampler: greedy parity with argmax, seeded reproducibility, warpers, logprobs,
penalties against a plain reference, min_tokens, and the device-resident output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qworker.engine.sampler import Sampler, seeded_uniforms
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Sequence
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


# ------------------------------------------------------------------ penalties


def _reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                         rep: float, pres: float, freq: float) -> torch.Tensor:
    """Plain per-token loops: transformers' repetition, then OpenAI's presence/frequency."""
    out = logits.clone()
    for tok in set(prompt) | set(output):
        v = out[tok].item()
        out[tok] = v / rep if v > 0 else v * rep
    for tok in set(output):
        c = output.count(tok)
        out[tok] -= freq * c + pres * (1.0 if c > 0 else 0.0)
    return out


def _with_output(prompt: list[int], output: list[int], params: SamplingParams,
                 index: int = 0) -> Sequence:
    seq = make_seq(prompt, params, index=index)
    seq.token_ids.extend(output)
    return seq


def test_penalties_match_a_plain_reference_on_the_logits() -> None:
    logits = _logits(4, seed=11)
    cases = [([3, 4, 5], [7, 7, 7, 9], 1.3, 0.5, 0.25), ([1, 2], [2, 40, 40], 1.0, -0.7, 1.5),
             ([10], [], 0.8, 2.0, 2.0), ([6, 6], [6, 11, 12, 11], 1.0, 0.0, -2.0)]
    seqs = [_with_output(p, o, SamplingParams(temperature=0, repetition_penalty=r,
                                              presence_penalty=pr, frequency_penalty=f))
            for p, o, r, pr, f in cases]
    sampler = Sampler()
    processed = logits.clone()
    sampler._token_counts(V, logits.device)
    counts = sampler._counts
    assert counts is not None
    slots = counts.slots_for(seqs)
    counts.apply(processed, np.arange(4), slots, *(np.array([c[k] for c in cases])
                                                   for k in (2, 3, 4)))
    for i, (p, o, r, pr, f) in enumerate(cases):
        expected = _reference_penalties(logits[i], p, o, r, pr, f)
        assert torch.allclose(processed[i], expected, atol=1e-5), i
    out = Sampler().sample(logits, seqs)
    ref = [_reference_penalties(logits[i], *c).argmax().item() for i, c in enumerate(cases)]
    assert out.token_ids == ref


def test_token_counts_advance_on_the_device_and_rebuild_when_tokens_differ() -> None:
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    seq = _with_output([1, 2], [5], params)
    sampler = Sampler()
    logits[0, 5] = 3.0  # penalized once: 2.0, still the best
    logits[0, 8] = 1.5
    first = sampler.sample(logits, [seq]).token_ids[0]
    assert first == 5
    seq.token_ids.append(first)  # the engine appends what the sampler drew
    counts = sampler._counts
    assert counts is not None and counts.counts[counts._slots[seq.seq_id].index, 5] == 2
    assert sampler.sample(logits, [seq]).token_ids[0] == 8  # 3 - 2 = 1 < 1.5
    # recompute after preemption keeps the tokens: nothing is recounted; a sequence whose
    # tokens were taken back is rebuilt from what it keeps
    del seq.token_ids[-2:]
    assert sampler.sample(logits, [seq]).token_ids[0] == 5
    assert counts.counts[counts._slots[seq.seq_id].index, 5] == 0 + 1  # drawn just now


def test_penalty_slots_are_reused_and_grow_without_mixing_sequences() -> None:
    sampler = Sampler()
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    logits = torch.zeros(1, V)
    logits[0, :3] = torch.tensor([1.0, 0.9, 0.8])
    seen = []
    for step in range(20):  # many short-lived sequences: slots recycled, never shared
        seq = _with_output([30 + step % 5], [0] if step % 2 else [], params)
        seen.append(sampler.sample(logits, [seq]).token_ids[0])
    assert seen == [0 if s % 2 == 0 else 1 for s in range(20)]
    many = [_with_output([1], [i % V], params) for i in range(40)]
    out = sampler.sample(logits.expand(40, V).contiguous(), many).token_ids
    assert out == [1 if i % V == 0 else 0 for i in range(40)]
    assert sampler._counts is not None and sampler._counts.counts.shape[0] >= 40


# ------------------------------------------------------------------ min_tokens


def test_min_tokens_forbids_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS is the best token
    logits[:, 7] = 9.0  # then a stop token id
    logits[:, 11] = 8.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    sampler = Sampler(eos_token_ids=[2])
    seqs = [_with_output([1], [4, 4], params), _with_output([1], [4, 4, 4], params)]
    assert sampler.sample(logits, seqs).token_ids == [11, 2]
    sampled = SamplingParams(temperature=1.0, seed=3, min_tokens=5, stop_token_ids=[7])
    for s in range(30):
        seq = _with_output([1], [], SamplingParams(temperature=1.0, seed=s, min_tokens=5,
                                                   stop_token_ids=[7]))
        assert sampler.sample(torch.zeros(1, V), [seq]).token_ids[0] not in (2, 7)
    assert sampled.min_tokens == 5


# ------------------------------------------------------------------ seeds, batching, output


def test_seeded_rows_are_identical_alone_batched_and_in_any_order() -> None:
    logits = _logits(6, seed=12)
    params = [SamplingParams(temperature=0.9, seed=s, top_k=k, top_p=p, min_p=m)
              for s, k, p, m in [(1, 0, 1.0, 0.0), (2, 5, 1.0, 0.0), (3, 0, 0.8, 0.0),
                                 (4, 0, 1.0, 0.05), (5, 7, 0.9, 0.02), (6, 0, 1.0, 0.0)]]
    seqs = [_with_output([1], [3] * i, p) for i, p in enumerate(params)]
    alone = [Sampler().sample(logits[i:i + 1], [seqs[i]]).token_ids[0] for i in range(6)]
    batched = Sampler().sample(logits, seqs).token_ids
    order = [4, 1, 5, 0, 3, 2]
    shuffled = Sampler().sample(logits[order], [seqs[i] for i in order]).token_ids
    with_greedy = Sampler().sample(torch.cat([logits, logits]), seqs + [
        make_seq([1], SamplingParams(temperature=0)) for _ in range(6)]).token_ids
    assert alone == batched == [shuffled[order.index(i)] for i in range(6)] == with_greedy[:6]


def test_seeded_uniforms_are_uniform_and_depend_on_every_input() -> None:
    n = 20000
    u = seeded_uniforms(np.arange(n, dtype=np.uint64), np.zeros(n, np.int64), np.zeros(n, np.int64))
    assert u.min() >= 0.0 and u.max() < 1.0
    hist = np.histogram(u, bins=10, range=(0, 1))[0]
    assert (abs(hist - n / 10) < 5 * np.sqrt(n / 10)).all()
    base = seeded_uniforms(np.array([7], np.uint64), np.array([0]), np.array([0]))
    for seed, index, pos in [(8, 0, 0), (7, 1, 0), (7, 0, 1)]:
        other = seeded_uniforms(np.array([seed], np.uint64), np.array([index]), np.array([pos]))
        assert other[0] != base[0]


def test_sampler_output_keeps_ids_on_the_device_and_unpacks_once() -> None:
    logits = _logits(3, seed=13)
    seqs = [make_seq([1], SamplingParams(temperature=0, logprobs=2)),
            make_seq([1], SamplingParams(temperature=0)),
            make_seq([1], SamplingParams(temperature=0.5, seed=1, logprobs=0))]
    out = Sampler().sample(logits, seqs)
    assert isinstance(out.token_ids_device, torch.Tensor) and len(out) == 3
    assert out.token_ids_device.tolist() == out.token_ids
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert set(out.top_logprobs[0]) == set(ref[0].topk(2).indices.tolist())
    assert out.top_logprobs[2] == {out.token_ids[2]: out.logprobs[2]}
    assert abs(out.logprobs[2] - ref[2, out.token_ids[2]].item()) < 1e-6
    plain = Sampler().sample(logits, [make_seq([1], SamplingParams(temperature=0))] * 3)
    assert plain.logprobs == [None] * 3 and plain.token_ids == logits.argmax(-1).tolist()


# ------------------------------------------------------------------ on the GPU


@pytest.mark.gpu
def test_cuda_sampler_matches_cpu_and_copies_back_once() -> None:
    logits = _logits(6, seed=21)
    seqs = [_with_output([1, 2], [5, 5], SamplingParams(temperature=0)),
            _with_output([1, 2], [5, 5], SamplingParams(temperature=0, repetition_penalty=1.5,
                                                        frequency_penalty=0.7, logprobs=3)),
            _with_output([1], [], SamplingParams(temperature=0, min_tokens=2)),
            _with_output([1], [9], SamplingParams(temperature=0.9, seed=4, top_k=5)),
            _with_output([1], [9], SamplingParams(temperature=0.7, seed=5, top_p=0.8)),
            _with_output([1], [9], SamplingParams(temperature=1.1, seed=6, min_p=0.1))]
    cpu = Sampler(eos_token_ids=[2]).sample(logits, seqs)
    gpu_sampler = Sampler("cuda", eos_token_ids=[2])
    out = gpu_sampler.sample(logits.cuda(), seqs)
    assert out.token_ids_device.is_cuda
    out.to_host()
    assert out.token_ids[:3] == cpu.token_ids[:3]
    assert out.top_logprobs[1] is not None and cpu.top_logprobs[1] is not None
    assert set(out.top_logprobs[1]) == set(cpu.top_logprobs[1])
    alone = [gpu_sampler.sample(logits[i:i + 1].cuda(), [seqs[i]]).token_ids[0] for i in (3, 4, 5)]
    assert alone == out.token_ids[3:]


@pytest.mark.gpu
def test_bitmask_unpacks_the_same_on_the_gpu() -> None:
    from qworker.engine.structured.bitmask import apply_token_bitmask, unpack_allowed

    rng = np.random.default_rng(3)
    words = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(4, 40), dtype=np.int64)
                             .astype(np.int32))
    cpu = unpack_allowed(words, 1270, torch.device("cpu"))
    gpu = unpack_allowed(words.pin_memory(), 1270, torch.device("cuda"))
    assert torch.equal(gpu.cpu(), cpu)
    logits = torch.randn(6, 1270)
    rows = np.array([5, 1, 0, 3])
    assert torch.equal(apply_token_bitmask(logits.cuda(), rows, gpu).cpu(),
                       apply_token_bitmask(logits, rows, cpu))


def test_penalty_counts_include_a_token_still_in_flight() -> None:
    # Overlapped steps: a sequence samples again before its last token reached the host
    # (num_pending); the device counts already hold that token.
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 8] = 3.0, 1.5
    seq = _with_output([1, 2], [5], SamplingParams(temperature=0, frequency_penalty=1.0))
    sampler = Sampler()
    assert sampler.sample(logits, [seq]).token_ids == [5]  # 3 - 1 = 2 > 1.5
    seq.num_pending = 1  # drawn, not appended yet
    assert sampler.sample(logits, [seq], output_positions=[2]).token_ids == [8]  # 3 - 2 < 1.5


@pytest.mark.gpu
def test_cuda_sampling_never_waits_for_the_device() -> None:
    # Every per-step array goes through pinned memory with non_blocking copies; the one
    # device-to-host copy is started by to_host() and only awaited by token_ids.
    logits = _logits(6, seed=22).cuda()
    seqs = [_with_output([1, 2], [5], SamplingParams(temperature=0, repetition_penalty=1.2,
                                                     presence_penalty=0.5)),
            _with_output([1], [], SamplingParams(temperature=0, min_tokens=3, logprobs=2)),
            _with_output([1], [9], SamplingParams(temperature=0.9, seed=4, top_k=5)),
            _with_output([1], [9], SamplingParams(temperature=0.7, seed=5, top_p=0.8,
                                                  min_p=0.05, frequency_penalty=1.0)),
            _with_output([1], [9], SamplingParams(temperature=1.0)),
            make_seq([1], SamplingParams(temperature=0))]
    sampler = Sampler("cuda", eos_token_ids=[2])
    assert len(sampler.sample(logits, seqs).token_ids) == 6  # warm-up: allocations, slots
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits, seqs)
        out.to_host()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(out.token_ids) == 6 and out.logprobs[1] is not None
