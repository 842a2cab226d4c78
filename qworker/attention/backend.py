"""The contract between the model runner, the models and an attention implementation.

KV memory layout (shared by every backend and by ``cuda/*.cu``)::

    KVCache.key[layer]   : [num_blocks, num_kv_heads, block_size, head_dim]
    KVCache.value[layer] : [num_blocks, num_kv_heads, block_size, head_dim]

(``KVCache.key`` is one tensor ``[num_layers, num_blocks, num_kv_heads, block_size,
head_dim]``, so one block of one head is ``block_size * head_dim`` contiguous
elements.) Token ``i`` of a sequence lives in block ``block_table[i // block_size]``
at offset ``i % block_size``; its *slot* is ``block * block_size + offset``.

A step's batch is flattened: ``num_tokens`` query tokens from ``num_seqs``
sequences, sequence ``s`` owning query rows ``query_start_loc[s]:query_start_loc[s+1]``.
Sequences whose query length is 1 (decodes) come first (``num_decodes`` of them),
then prefill chunks. Every query token attends causally to all earlier tokens of
its own sequence: the ``seq_lens[s] - query_len`` tokens already cached plus the
earlier tokens of its own chunk (which ``write_kv`` has stored before ``forward``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVCache:
    """The paged KV pool of one device: key and value tensors for all layers."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool (the same for every layer)."""
        return self.key.shape[1]

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.key.shape[3]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> KVCache:
        """Allocate a zeroed pool (``pin_memory`` for a host swap pool next to a GPU)."""
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        return cls(
            key=torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
            value=torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block costs across all layers, keys and values together."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * block_size * head_dim * elem


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens come from and go to; built once per step, shared by all layers.

    All tensors live on the model's device. ``block_tables`` rows are padded with 0
    past a sequence's last block (never read: ``seq_lens`` bounds every read).
    ``slot_mapping`` is -1 for padding tokens, whose K/V must not be written.
    ``max_query_len`` and ``max_seq_len`` are Python ints for launch sizing.
    ``sliding_window`` (tokens, or None) limits how far back a query may attend.
    ``query_start_loc_cpu`` / ``seq_lens_cpu``, when set, are host copies of those two
    tensors (the runner has them anyway), so a backend never reads device tensors back
    inside the forward. ``cuda_graph`` is True while the step is captured into a CUDA
    graph that later steps replay: launch sizes must then depend only on tensor shapes
    and ``max_seq_len`` (set to ``max_model_len``), never on values, the host copies
    are None, and nothing may be compiled or initialised (a warm-up forward with the
    same metadata runs first).
    """

    num_seqs: int
    num_tokens: int
    num_decodes: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], cached + new tokens after this step
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    max_query_len: int
    max_seq_len: int
    sliding_window: int | None = None
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    cuda_graph: bool = False


class AttentionBackend(ABC):
    """One implementation of paged attention and its cache operations.

    Implementations must be stateless apart from compiled-kernel caches, so one
    instance can serve every layer. They run on the caller's (torch's current) stream.
    """

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into one layer's
        cache ``[num_blocks, num_kv_heads, block_size, head_dim]`` at ``slot_mapping``;
        slots equal to -1 are skipped."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attend ``query`` ``[num_tokens, num_q_heads, head_dim]`` over one layer's paged
        cache (after ``write_kv`` for this step) and return ``[num_tokens, num_q_heads,
        head_dim]`` in the query's dtype. ``num_q_heads`` is a multiple of the cache's
        ``num_kv_heads`` (GQA/MQA); softmax and accumulation are in fp32."""

    @abstractmethod
    def copy_blocks(self, kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` (int64 tensors) in every layer, keys and
        values (copy-on-write)."""

    @abstractmethod
    def swap_blocks(
        self, src_cache: KVCache, dst_cache: KVCache, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy blocks ``src[i]`` of ``src_cache`` to ``dst[i]`` of ``dst_cache`` in every
        layer; the two pools may be on different devices (device <-> pinned host)."""
