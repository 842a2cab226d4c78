"""The pool of KV blocks: reference counts, an O(1) free queue and the prefix cache.

Block *ids* index the device KV pool (``KVCache``); this module only does the
bookkeeping. A block with ``ref_cnt == 0`` sits in the free queue. With prefix
caching on, a freed block keeps its content and its hash, so a later request
whose prompt starts with the same tokens can take it back out of the middle of
the free queue (that is why the queue is doubly linked). Blocks are handed out
from the queue's head, so the least recently freed cached block is evicted
first; callers free a sequence's blocks tail first, so a request's private tail
goes before the head it may share with others.

Not thread-safe: the engine thread alone calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = int


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: depends on every token before it through ``parent_hash``."""
    return hash((parent_hash, tuple(token_ids)))


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of the pool; ``block_hash`` is set while it is in the prefix cache.

    ``token_ids`` and ``parent_hash`` are kept with the hash so a lookup can reject a
    hash collision instead of serving another prompt's keys and values.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked queue of free blocks: O(1) pop from the head, append, and remove anywhere."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Take the block at the head (the eviction candidate); raises IndexError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail: evicted after everything already queued."""
        self._link(block, self._tail.prev_free, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the head: the next one handed out."""
        self._link(block, self._head, self._head.next_free)  # type: ignore[arg-type]

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """All ``num_blocks`` blocks, their reference counts and the prefix-cache index.

    ``get_new_blocks`` hands out blocks with ``ref_cnt == 1`` (evicting cached
    content if needed); ``touch`` takes extra references (sharing, cache hits);
    ``free_blocks`` drops references. Counters ``prefix_cache_queries`` and
    ``prefix_cache_hits`` count prompt tokens looked up and found.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references (cached ones included: they can be evicted)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Share of the pool referenced by live sequences, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks (each with one reference); ValueError if fewer are free."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot take {n} blocks, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block, pulling free (cached) ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (pass tail first).

        A block reaching zero joins the free queue: cached blocks at the tail (kept as
        long as possible), uncached ones at the head (reused first, nothing is lost).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(
        self, parent_hash: BlockHash | None, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> KVBlock | None:
        """The cached block holding exactly ``token_ids`` after ``parent_hash``, or None."""
        if not self.enable_caching:
            return None
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(
        self,
        block: KVBlock,
        parent_hash: BlockHash | None,
        block_hash: BlockHash,
        token_ids: Sequence[int],
    ) -> None:
        """Enter a block that was just filled into the prefix cache (first one wins)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:  # type: ignore[arg-type]
            del self.cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody references (contents become garbage)."""
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                self._evict(block)
