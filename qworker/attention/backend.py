"""The contract between the model runner, the models and an attention implementation.

KV memory layout (shared by every backend and by ``cuda/*.cu``)::

    KVCache.key[layer]   : [num_blocks, num_kv_heads, block_size, head_dim]
    KVCache.value[layer] : [num_blocks, num_kv_heads, block_size, head_dim]

(``KVCache.key`` is one tensor ``[num_layers, num_blocks, num_kv_heads, block_size,
head_dim]``, so one block of one head is ``block_size * head_dim`` contiguous
elements.) The elements are the model dtype, or FP8 E4M3 (``kv_cache_dtype="fp8_e4m3"``,
one byte each) with per-layer scales in ``KVCache.scales`` (:mod:`qworker.attention.fp8`).
Token ``i`` of a sequence lives in block ``block_table[i // block_size]`` at offset
``i % block_size``; its *slot* is ``block * block_size + offset``.

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
from typing import Any

import torch

from qworker.attention.fp8 import KVScales, is_fp8, register_pool


@dataclass(slots=True)
class KVCache:
    """The paged KV pool of one device: key and value tensors for all layers.

    ``scales`` holds the per-layer K/V scales of an FP8 pool (None otherwise).
    """

    key: torch.Tensor
    value: torch.Tensor
    scales: KVScales | None = None

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
        """Allocate a zeroed pool (``pin_memory`` for a host swap pool next to a GPU).

        ``dtype`` FP8 (:data:`qworker.attention.fp8.FP8_DTYPE`) also allocates the
        per-layer scales, uncalibrated (set by each layer's first write), and registers the
        pool so backends find them from a layer's cache tensor.
        """
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        pool = cls(
            key=torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
            value=torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory),
        )
        if is_fp8(dtype):
            pool.scales = KVScales.allocate(num_layers, device)
            register_pool(pool.key, pool.scales)
        return pool

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
    ``sliding_window`` (tokens, or None) limits how far back a query may attend: query
    position ``q`` sees keys ``k`` with ``q - window < k <= q``. ``logits_soft_cap`` (or
    None) caps the scaled scores before the softmax: ``s -> cap * tanh(s / cap)`` (Gemma 2).
    A model whose layers differ in either gets one derived metadata per (window, cap)
    (``qworker.attention.paged_attention.current_metadata``).

    Optional, for speed: ``host_query_start_loc`` / ``host_seq_lens`` are host copies
    (numpy or lists) of the two tensors, which spares a backend the device-to-host read its
    prefill planning would otherwise do; ``decode_plan`` is a fixed launch plan from the
    backend (``CudaAttentionBackend.plan_decode``) that the decode launch then uses as is, so
    a captured CUDA graph stays valid while ``seq_lens`` grows (see cuda/NOTES.md).
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
    logits_soft_cap: float | None = None
    host_query_start_loc: Any = None
    host_seq_lens: Any = None
    decode_plan: Any = None


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
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into one layer's
        cache ``[num_blocks, num_kv_heads, block_size, head_dim]`` at ``slot_mapping``;
        slots equal to -1 are skipped. An FP8 cache quantizes with the layer's
        ``{k_scale, v_scale}`` (``kv_scales``, else found from the pool, see
        :mod:`qworker.attention.fp8`)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``query`` ``[num_tokens, num_q_heads, head_dim]`` over one layer's paged
        cache (after ``write_kv`` for this step) and return ``[num_tokens, num_q_heads,
        head_dim]`` in the query's dtype. ``num_q_heads`` is a multiple of the cache's
        ``num_kv_heads`` (GQA/MQA); softmax and accumulation are in fp32. An FP8 cache is
        read with ``kv_scales`` as in ``write_kv``."""

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
