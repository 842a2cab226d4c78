"""Per-sequence block tables on top of the block pool: allocation, sharing, swap.

A sequence of ``L`` tokens whose keys and values are (or are about to be) in the
cache holds ``ceil(L / block_size)`` blocks; it takes another block only when a
token crosses a block boundary, so at most ``block_size - 1`` slots are idle.

Sharing: ``fork`` gives a new sequence the same blocks (reference counts go up).
The first write into a block that is still shared copies it first: the manager
swaps a fresh block into the writer's table and queues ``(src, dst)`` in
``pending_copies``, which the model runner executes through
``AttentionBackend.copy_blocks`` before the step's forward.

Swap: ``swap_out`` moves a sequence's blocks to a host pool of ``num_swap_blocks``
(the caller copies the returned ``(device, host)`` pairs), ``swap_in`` brings them
back into fresh device blocks.

Not thread-safe: the engine thread alone calls it.
"""

from __future__ import annotations

from qworker.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from qworker.engine.sequence import Sequence


class KVCacheManager:
    """Block tables of every live sequence, over one ``BlockPool`` and a host swap pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_swap_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[int, list[KVBlock]] = {}
        self.table_ids: dict[int, list[int]] = {}
        self._num_cached: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self._keys: dict[int, int] = {}
        self._next_key = 0
        self.num_swap_blocks = num_swap_blocks
        self._free_host = list(range(num_swap_blocks - 1, -1, -1))
        self.host_tables: dict[int, list[int]] = {}

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Device blocks nobody references."""
        return self.pool.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        """Host swap blocks not holding a swapped sequence."""
        return len(self._free_host)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: int) -> list[int]:
        """The sequence's block table as block ids (the live list: do not mutate)."""
        return self.table_ids.get(seq_id, [])

    def table_key(self, seq_id: int) -> int:
        """Changes whenever the sequence's table changes other than by appending blocks
        (new table, copy-on-write, swap-in); never reused. The model runner keeps its
        device block table row as long as the key holds and only appends."""
        return self._keys.get(seq_id, -1)

    def step_tables(self, seq_ids: list[int]) -> tuple[list[list[int]], list[int]]:
        """``block_ids`` and ``table_key`` of each sequence, for a step's inputs."""
        ids, keys = self.table_ids, self._keys
        return [ids.get(s, []) for s in seq_ids], [keys.get(s, -1) for s in seq_ids]

    def _new_key(self, seq_id: int) -> None:
        self._keys[seq_id] = self._next_key
        self._next_key += 1

    # ---- prefix cache --------------------------------------------------------------

    def _update_hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        hashes = seq.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """The longest cached run of the sequence's leading full blocks.

        It never covers the last token, which must be recomputed to produce logits.
        Takes no reference: pass the result to ``allocate_slots``.
        """
        if not self.pool.enable_caching or seq.num_computed_tokens or self.tables.get(seq.seq_id):
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._update_hashes(seq, max_blocks)
        bs = self.block_size
        found: list[KVBlock] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            block = self.pool.lookup(parent, hashes[i], seq.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            found.append(block)
            parent = hashes[i]
        return found

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        # Only tokens known on the host can be hashed: a pending token's block waits.
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        start = self._num_cached.get(seq.seq_id, 0)
        if known // self.block_size <= start:  # the common case: no block completed
            return
        table = self.tables.get(seq.seq_id)
        if not table:
            return
        num_full = min(known // self.block_size, len(table))
        if num_full <= start:
            return
        hashes = self._update_hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            self.pool.cache_block(table[i], parent, hashes[i], seq.token_ids[i * bs : (i + 1) * bs])
        self._num_cached[seq.seq_id] = num_full

    # ---- allocation ----------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` tokens after the computed ones; False if the pool
        is too full (nothing changes then).

        ``computed_blocks`` (from ``get_computed_blocks``, only for a sequence without
        blocks) are shared into the table and count as computed: the caller adds
        ``len(computed_blocks) * block_size`` to ``num_computed_tokens``. A shared block
        about to be written is replaced by a private copy (see ``pending_copies``).
        """
        table = self.tables.get(seq.seq_id)
        if not computed_blocks and table:
            # Fast path of a decode: the new tokens fit in the last block, which is private.
            bs = self.block_size
            done = seq.num_computed_tokens
            if (done // bs == len(table) - 1 and (done + num_new_tokens + bs - 1) // bs
                    <= len(table) and table[-1].ref_cnt == 1):
                return True
        computed_blocks = computed_blocks or []
        if table is None:
            table = []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        total_blocks = self.blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, total_blocks - len(table) - len(computed_blocks))
        first_write = num_computed // self.block_size
        cow = [i for i in range(first_write, len(table)) if table[i].ref_cnt > 1]
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + len(cow) + num_revived > self.pool.num_free_blocks:
            return False
        if seq.seq_id not in self.tables:
            self.tables[seq.seq_id] = table
            self.table_ids[seq.seq_id] = []
            self._new_key(seq.seq_id)
        ids = self.table_ids[seq.seq_id]
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            ids.extend(b.block_id for b in computed_blocks)
            self._num_cached[seq.seq_id] = len(table)
            self.pool.prefix_cache_hits += len(computed_blocks) * self.block_size
        for i in cow:
            self._copy_on_write(seq.seq_id, i)
        if num_new_blocks:
            new = self.pool.get_new_blocks(num_new_blocks)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        return True

    def record_prefix_query(self, num_tokens: int) -> None:
        """Count ``num_tokens`` prompt tokens looked up in the prefix cache (stats only)."""
        if self.pool.enable_caching:
            self.pool.prefix_cache_queries += num_tokens

    def _copy_on_write(self, seq_id: int, index: int) -> None:
        old = self.tables[seq_id][index]
        (new,) = self.pool.get_new_blocks(1)
        self.pending_copies.append((old.block_id, new.block_id))
        self.pool.free_blocks([old])
        self.tables[seq_id][index] = new
        self.table_ids[seq_id][index] = new.block_id
        self._new_key(seq_id)
        # The copy is private and may yet be written: only full blocks before it stay cached.
        self._num_cached[seq_id] = min(self._num_cached.get(seq_id, 0), index)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the copy-on-write ``(src, dst)`` pairs queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Give ``child_seq_id`` the parent's blocks, shared (reference counts + 1).

        Either sequence's first write into a shared block copies it first. The child
        must not hold blocks yet.
        """
        if self.tables.get(child_seq_id):
            raise ValueError(f"sequence {child_seq_id} already holds blocks")
        table = self.tables.get(parent_seq_id, [])
        self.pool.touch(table)
        self.tables[child_seq_id] = list(table)
        self.table_ids[child_seq_id] = list(self.table_ids.get(parent_seq_id, []))
        self._new_key(child_seq_id)
        self._num_cached[child_seq_id] = self._num_cached.get(parent_seq_id, 0)

    def free(self, seq_id: int) -> None:
        """Release every block the sequence holds, on device and on host (tail first)."""
        table = self.tables.pop(seq_id, None)
        self.table_ids.pop(seq_id, None)
        self._keys.pop(seq_id, None)
        self._num_cached.pop(seq_id, None)
        if table:
            self.pool.free_blocks(reversed(table))
        host = self.host_tables.pop(seq_id, None)
        if host:
            self._free_host.extend(reversed(host))

    # ---- swap ----------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        """True if the host pool has room for all of the sequence's blocks."""
        return len(self.tables.get(seq_id, ())) <= len(self._free_host)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence to host blocks; returns ``(device, host)`` pairs to copy now.

        The device blocks are released, so copy before anything else is written.
        """
        table = self.tables.get(seq_id, [])
        if len(table) > len(self._free_host):
            raise ValueError(f"swap space too small for sequence {seq_id}")
        host = [self._free_host.pop() for _ in table]
        pairs = [(b.block_id, h) for b, h in zip(table, host, strict=True)]
        self.free(seq_id)
        self.host_tables[seq_id] = host
        return pairs

    def can_swap_in(self, seq_id: int, num_extra: int = 1) -> bool:
        """True if the device pool can take the swapped blocks plus ``num_extra`` more."""
        return len(self.host_tables.get(seq_id, ())) + num_extra <= self.pool.num_free_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks; returns ``(host, device)``
        pairs to copy before the sequence's next forward."""
        host = self.host_tables.pop(seq_id)
        blocks = self.pool.get_new_blocks(len(host))
        self.tables[seq_id] = blocks
        self.table_ids[seq_id] = [b.block_id for b in blocks]
        self._new_key(seq_id)
        self._num_cached[seq_id] = len(blocks)  # never re-register: content came from the host
        self._free_host.extend(reversed(host))
        return [(h, b.block_id) for h, b in zip(host, blocks, strict=True)]
