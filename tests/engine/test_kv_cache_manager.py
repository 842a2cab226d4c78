"""KV cache manager: block accounting, prefix reuse, fork with copy-on-write, swap.

The property test drives random operation sequences against a simulated KV pool
(one token id per slot) and checks after every operation that reference counts
match the tables, no block is leaked or double-owned, and every computed token of
every sequence reads back through its block table (so neither a cache hit nor a
copy-on-write nor eviction ever hands out corrupted blocks).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.sequence import Sequence
from tests.engine.helpers import make_seq

B = 4


class SimulatedPool:
    """A KV manager plus the token each slot holds on 'device' and 'host'."""

    def __init__(self, num_blocks: int, num_swap: int, caching: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, B, caching, num_swap)
        self.device = [[None] * B for _ in range(num_blocks)]
        self.host = [[None] * B for _ in range(num_swap)]

    def write(self, seq: Sequence, n: int) -> None:
        for src, dst in self.kv.take_pending_copies():
            self.device[dst] = list(self.device[src])
        table = self.kv.block_ids(seq.seq_id)
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.device[table[p // B]][p % B] = seq.token_ids[p]
        seq.num_computed_tokens += n
        self.kv.cache_full_blocks(seq)

    def admit(self, seq: Sequence, chunk: int) -> bool:
        computed = self.kv.get_computed_blocks(seq)
        hit = len(computed) * B
        n = min(seq.num_tokens - hit, chunk)
        if not self.kv.allocate_slots(seq, n, computed):
            return False
        seq.num_computed_tokens += hit
        self.write(seq, n)
        return True

    def check(self, live: list[Sequence]) -> None:
        kv = self.kv
        owners = Counter()
        for seq in live:
            ids = kv.block_ids(seq.seq_id)
            assert len(ids) == len(set(ids)), "a table holds a block twice"
            assert ids == [b.block_id for b in kv.tables.get(seq.seq_id, [])]
            owners.update(ids)
            if seq.seq_id not in kv.host_tables:
                assert len(ids) == kv.blocks_for(seq.num_computed_tokens) or (
                    len(ids) >= kv.blocks_for(seq.num_computed_tokens)
                )
                for p in range(seq.num_computed_tokens):
                    assert self.device[ids[p // B]][p % B] == seq.token_ids[p], "corrupted KV"
        assert set(kv.tables) == {s.seq_id for s in live if s.seq_id in kv.tables}
        free_ids = {b.block_id for b in kv.pool.free_queue}
        assert len(free_ids) == kv.pool.num_free_blocks
        for block in kv.pool.blocks:
            assert block.ref_cnt == owners[block.block_id], "ref count != owners"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids)
        for h, block in kv.pool.cached.items():
            assert block.block_hash == h
        host_used = [h for t in kv.host_tables.values() for h in t]
        assert len(host_used) == len(set(host_used))
        assert len(host_used) + kv.num_free_host_blocks == kv.num_swap_blocks


OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "admit", "step", "fork", "free", "preempt", "swap_out",
                         "swap_in"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 16), chunk=st.integers(1, 9),
       caching=st.booleans())
def test_no_block_leaked_double_owned_or_corrupted_under_random_operations(
    ops: list[tuple[str, int, list[int]]], num_blocks: int, chunk: int, caching: bool
) -> None:
    sim = SimulatedPool(num_blocks, num_swap=8, caching=caching)
    kv = sim.kv
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    swapped: list[Sequence] = []
    for op, k, tokens in ops:
        if op == "new":
            waiting.append(make_seq(tokens))
        elif op == "admit" and waiting:
            seq = waiting[k % len(waiting)]
            if sim.admit(seq, chunk):
                waiting.remove(seq)
                running.append(seq)
        elif op == "step" and running:
            seq = running[k % len(running)]
            if seq.num_uncomputed_tokens == 0:
                seq.token_ids.append(k % 3)
            n = min(seq.num_uncomputed_tokens, chunk)
            if kv.allocate_slots(seq, n):
                sim.write(seq, n)
        elif op == "fork" and running:
            parent = running[k % len(running)]
            child = make_seq(parent.token_ids, request=parent.request, index=1)
            child.num_computed_tokens = parent.num_computed_tokens
            kv.fork(parent.seq_id, child.seq_id)
            running.append(child)
        elif op == "free" and (running or waiting or swapped):
            pool = [*running, *waiting, *swapped]
            seq = pool[k % len(pool)]
            kv.free(seq.seq_id)
            for q in (running, waiting, swapped):
                if seq in q:
                    q.remove(seq)
        elif op == "preempt" and running:
            seq = running.pop(k % len(running))
            kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            waiting.append(seq)
        elif op == "swap_out" and running:
            seq = running[k % len(running)]
            if kv.can_swap_out(seq.seq_id):
                for src, dst in kv.take_pending_copies():
                    sim.device[dst] = list(sim.device[src])
                for dev, host in kv.swap_out(seq.seq_id):
                    sim.host[host] = list(sim.device[dev])
                running.remove(seq)
                swapped.append(seq)
        elif op == "swap_in" and swapped:
            seq = swapped[k % len(swapped)]
            if kv.can_swap_in(seq.seq_id, 0):
                for host, dev in kv.swap_in(seq.seq_id):
                    sim.device[dev] = list(sim.host[host])
                swapped.remove(seq)
                running.append(seq)
        sim.check([*running, *waiting, *swapped])
    for seq in [*running, *waiting, *swapped]:
        kv.free(seq.seq_id)
    assert kv.pool.num_free_blocks == num_blocks
    assert kv.num_free_host_blocks == 8
    assert not kv.tables and not kv.host_tables


def test_sequence_takes_a_block_only_when_crossing_a_boundary() -> None:
    sim = SimulatedPool(8, 0)
    seq = make_seq(list(range(5)))
    assert sim.admit(seq, 100)
    assert len(sim.kv.block_ids(seq.seq_id)) == 2
    for expected_blocks in (2, 2, 2, 3):  # tokens 6, 7, 8 fit block 2; token 9 opens block 3
        seq.token_ids.append(1)
        assert sim.kv.allocate_slots(seq, 1)
        sim.write(seq, 1)
        assert len(sim.kv.block_ids(seq.seq_id)) == expected_blocks


def test_prefix_hit_reuses_full_blocks_but_recomputes_the_last_token() -> None:
    sim = SimulatedPool(16, 0)
    first = make_seq(list(range(12)))
    assert sim.admit(first, 100)
    second = make_seq(list(range(12)))  # identical: 3 full blocks, last one recomputed
    computed = sim.kv.get_computed_blocks(second)
    assert [b.block_id for b in computed] == sim.kv.block_ids(first.seq_id)[:2]
    third = make_seq([*range(8), 99, 98, 97, 96, 95])
    assert len(sim.kv.get_computed_blocks(third)) == 2
    assert sim.admit(third, 100)
    assert sim.kv.block_ids(third.seq_id)[:2] == sim.kv.block_ids(first.seq_id)[:2]
    assert sim.kv.pool.prefix_cache_hits == 8


def test_fork_shares_blocks_and_first_write_copies_the_shared_partial_block() -> None:
    sim = SimulatedPool(8, 0)
    parent = make_seq(list(range(6)))
    assert sim.admit(parent, 100)
    child = make_seq(parent.token_ids, request=parent.request, index=1)
    child.num_computed_tokens = parent.num_computed_tokens
    sim.kv.fork(parent.seq_id, child.seq_id)
    assert sim.kv.block_ids(child.seq_id) == sim.kv.block_ids(parent.seq_id)
    assert sim.kv.pool.num_used_blocks == 2
    child.token_ids.append(50)
    assert sim.kv.allocate_slots(child, 1)
    copies = sim.kv.pending_copies[:]
    assert copies == [(sim.kv.block_ids(parent.seq_id)[1], sim.kv.block_ids(child.seq_id)[1])]
    sim.write(child, 1)
    parent.token_ids.append(60)
    assert sim.kv.allocate_slots(parent, 1)
    assert sim.kv.pending_copies == []  # the last holder writes in place
    sim.write(parent, 1)
    assert sim.kv.block_ids(child.seq_id)[0] == sim.kv.block_ids(parent.seq_id)[0]
    sim.check([parent, child])


def test_allocation_failure_changes_nothing() -> None:
    sim = SimulatedPool(2, 0)
    seq = make_seq(list(range(12)))
    assert not sim.admit(seq, 100)
    assert sim.kv.pool.num_free_blocks == 2 and not sim.kv.tables


def test_swap_out_and_in_restores_the_sequence_content() -> None:
    sim = SimulatedPool(4, 4)
    seq = make_seq(list(range(7)))
    assert sim.admit(seq, 100)
    for dev, host in sim.kv.swap_out(seq.seq_id):
        sim.host[host] = list(sim.device[dev])
    assert sim.kv.pool.num_free_blocks == 4
    assert sim.kv.can_swap_in(seq.seq_id)
    for host, dev in sim.kv.swap_in(seq.seq_id):
        sim.device[dev] = list(sim.host[host])
    sim.check([seq])
    assert sim.kv.num_free_host_blocks == 4
