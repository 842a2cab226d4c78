"""Scheduler: token budget, chunked prefill, FCFS admission and preemption."""

from __future__ import annotations

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.scheduler import Scheduler, SchedulerOutput
from qworker.engine.sequence import SequenceStatus
from tests.engine.helpers import make_seq


def _advance(out: SchedulerOutput, kv: KVCacheManager) -> None:
    """What the engine does after a forward: mark tokens computed, append a token."""
    kv.take_pending_copies()
    for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        kv.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    kv = KVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    seq = make_seq(list(range(20)))
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        chunks.append(out.num_new_tokens)
        _advance(out, kv)
    assert chunks == [[8], [8], [4]]
    assert seq.num_output_tokens == 1


def test_step_mixes_decodes_with_a_new_prefill_chunk() -> None:
    kv = KVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a = make_seq([1, 2, 3])
    sched.add(a)
    _advance(sched.schedule(), kv)
    b = make_seq(list(range(30)))
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 9]


def test_admission_respects_max_num_seqs_in_arrival_order() -> None:
    kv = KVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq([i + 1] * 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == seqs[:2]
    assert list(sched.waiting) == seqs[2:]


def test_pool_exhaustion_preempts_the_newest_sequence_and_requeues_it_first() -> None:
    kv = KVCacheManager(4, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_seq([1, 2, 3, 4, 5, 6, 7]), make_seq([9, 8, 7, 6, 5, 4, 3])
    sched.add(old)
    sched.add(new)
    _advance(sched.schedule(), kv)  # both prefilled: 2 blocks each, pool full
    _advance(sched.schedule(), kv)  # 8 tokens each: still 2 blocks
    out = sched.schedule()  # each needs a third block: `new` must go
    assert out.preempted == [new]
    assert out.seqs == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new
    assert sched.num_preemptions == 1
    assert kv.num_free_blocks == 1


def test_swap_mode_swaps_out_and_resumes_without_recompute() -> None:
    kv = KVCacheManager(4, 4, num_swap_blocks=8)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, preemption_mode="swap")
    old, new = make_seq([1, 2, 3, 4, 5, 6, 7]), make_seq([9, 8, 7, 6, 5, 4, 3])
    sched.add(old)
    sched.add(new)
    _advance(sched.schedule(), kv)
    _advance(sched.schedule(), kv)
    out = sched.schedule()
    assert out.preempted == [new] and len(out.swap_out) == 2
    assert new.status is SequenceStatus.SWAPPED and new.num_computed_tokens == 8
    _advance(out, kv)
    sched.finish(old, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert out.seqs == [new] and len(out.swap_in) == 2 and out.num_new_tokens == [1]


def test_swap_mode_falls_back_to_recompute_when_swap_space_is_full() -> None:
    kv = KVCacheManager(4, 4, num_swap_blocks=1)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, preemption_mode="swap")
    old, new = make_seq([1, 2, 3, 4, 5, 6, 7]), make_seq([9, 8, 7, 6, 5, 4, 3])
    sched.add(old)
    sched.add(new)
    _advance(sched.schedule(), kv)
    _advance(sched.schedule(), kv)
    out = sched.schedule()
    assert out.preempted == [new] and out.swap_out == []
    assert new.status is SequenceStatus.WAITING


def test_finishing_releases_every_block() -> None:
    kv = KVCacheManager(8, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [make_seq([i + 1] * 6) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _advance(sched.schedule(), kv)
    for s in seqs:
        sched.finish(s, SequenceStatus.FINISHED_STOPPED)
    assert kv.num_free_blocks == 8 and not sched.has_unfinished()
