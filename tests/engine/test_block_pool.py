"""Block pool: reference counts, the free queue and prefix-cache eviction order."""

from __future__ import annotations

import pytest

from qworker.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens


def test_free_queue_removes_from_the_middle_in_constant_links() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.num_free == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert [b.block_id for b in queue] == [0, 1, 3, 4, 2]


def test_free_queue_rejects_double_insert() -> None:
    block = KVBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(ValueError):
        queue.append(block)


def test_new_blocks_are_referenced_once_and_freeing_returns_them() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    pool.free_blocks(blocks[:1])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free_blocks(blocks[:1])


def test_taking_more_blocks_than_free_fails_without_side_effects() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_cached_block_is_found_only_for_identical_tokens_and_parent() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(block, None, h, [1, 2, 3, 4])
    assert pool.lookup(None, h, [1, 2, 3, 4]) is block
    assert pool.lookup(None, h, [1, 2, 3, 5]) is None  # a forged collision is rejected
    assert pool.lookup(7, h, [1, 2, 3, 4]) is None


def test_freed_cached_block_can_be_revived_until_evicted_lru_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    for block, tokens in ((a, [1]), (b, [2]), (c, [3])):
        pool.cache_block(block, None, hash_block_tokens(None, tokens), tokens)
    pool.free_blocks([c, b, a])  # tail first: c is the eviction candidate
    (taken,) = pool.get_new_blocks(1)
    assert taken is c and c.block_hash is None
    assert pool.lookup(None, hash_block_tokens(None, [3]), [3]) is None
    hit = pool.lookup(None, hash_block_tokens(None, [1]), [1])
    assert hit is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(2)
    cached, plain = pool.get_new_blocks(2)
    pool.cache_block(cached, None, hash_block_tokens(None, [9]), [9])
    pool.free_blocks([cached, plain])
    (taken,) = pool.get_new_blocks(1)
    assert taken is plain
    assert pool.lookup(None, hash_block_tokens(None, [9]), [9]) is cached


def test_caching_disabled_never_finds_blocks() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_block(block, None, h, [1])
    assert pool.lookup(None, h, [1]) is None
