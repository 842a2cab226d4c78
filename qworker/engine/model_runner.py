"""The model runner: owns the model, the paged KV pool and the attention backend.

It sizes the pool (an exact ``num_kv_blocks``; on CPU ``kv_cache_memory`` bytes,
1 GiB by default; on GPU ``gpu_memory_utilization`` of the device minus the weights
and the activation peak of a profiling forward at ``max_num_batched_tokens``), and
turns a scheduled step into one forward: metadata built with tensor ops (decodes
first, then prefill chunks), block copies executed first, logits computed only for
the rows that sample.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from qworker.attention.paged_attention import bind_kv_cache, forward_context
from qworker.models.base import CausalLM, ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 1 << 30


@dataclass(slots=True)
class StepInput:
    """One step as the runner sees it: per sequence its block ids, context and new tokens.

    ``sample[i]`` tells whether sequence ``i`` needs logits (its last token is in the step).
    """

    token_chunks: list[list[int]]
    num_computed: list[int]
    block_tables: list[list[int]]
    sample: list[bool]


class ModelRunner:
    """Runs the model over a paged KV pool; not thread-safe (the engine thread only)."""

    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        device: torch.device,
        block_size: int,
        num_blocks: int,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.kv_cache = self._allocate(num_blocks)
        bind_kv_cache(model, self.kv_cache, backend)
        self.swap_cache: KVCache | None = None

    def _allocate(self, num_blocks: int) -> KVCache:
        spec = self.spec
        return KVCache.allocate(
            spec.num_layers, num_blocks, spec.num_kv_heads, self.block_size, spec.head_dim,
            spec.dtype, self.device,
        )

    def reallocate_pool(self, num_blocks: int) -> None:
        """Replace the device pool by a zeroed one of ``num_blocks`` blocks (after profiling)."""
        self.kv_cache = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_cache = self._allocate(num_blocks)
        bind_kv_cache(self.model, self.kv_cache, self.backend)

    def attach_swap_pool(self, num_blocks: int) -> None:
        """Allocate the host pool swapped-out blocks go to (pinned next to a GPU)."""
        if num_blocks:
            spec = self.spec
            self.swap_cache = KVCache.allocate(
                spec.num_layers, num_blocks, spec.num_kv_heads, self.block_size, spec.head_dim,
                spec.dtype, "cpu", pin_memory=self.device.type == "cuda",
            )

    def bytes_per_block(self) -> int:
        """Bytes one block costs across all layers, keys and values."""
        spec = self.spec
        return KVCache.bytes_per_block(
            spec.num_layers, spec.num_kv_heads, self.block_size, spec.head_dim, spec.dtype
        )

    # ---- block movement ------------------------------------------------------------

    def _pairs(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(pairs, dtype=torch.long)
        return t[:, 0], t[:, 1]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (``(device, host)`` pairs)."""
        if pairs and self.swap_cache is not None:
            src, dst = self._pairs(pairs)
            self.backend.swap_blocks(self.kv_cache, self.swap_cache, src.to(self.device), dst)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks (``(host, device)`` pairs)."""
        if pairs and self.swap_cache is not None:
            src, dst = self._pairs(pairs)
            self.backend.swap_blocks(self.swap_cache, self.kv_cache, src, dst.to(self.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole device blocks (``(src, dst)`` pairs)."""
        if pairs:
            src, dst = self._pairs(pairs)
            self.backend.copy_blocks(self.kv_cache, src.to(self.device), dst.to(self.device))

    # ---- forward -------------------------------------------------------------------

    def build(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten a step into input ids, positions and attention metadata (on device).

        Sequences must already be ordered decodes first.
        """
        bs = self.block_size
        q_lens = np.fromiter((len(c) for c in step.token_chunks), dtype=np.int64,
                             count=len(step.token_chunks))
        ctx = np.asarray(step.num_computed, dtype=np.int64)
        num_seqs = len(q_lens)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = ctx + q_lens
        max_blocks = max((len(t) for t in step.block_tables), default=1) or 1
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, t in enumerate(step.block_tables):
            tables[i, : len(t)] = t
        input_ids = np.fromiter(
            itertools.chain.from_iterable(step.token_chunks), dtype=np.int64, count=num_tokens
        )
        # position of each query token = its sequence's context length + its offset in the chunk
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - ctx, q_lens)
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        num_decodes = int(np.argmax(q_lens != 1)) if (q_lens != 1).any() else num_seqs
        dev = self.device
        meta = AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(q_lens.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
        )
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Run one forward; return fp32 logits of the sampling rows, in order (or None)."""
        input_ids, positions, meta = self.build(step)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        rows = [i for i, s in enumerate(step.sample) if s]
        if not rows:
            return None
        last = meta.query_start_loc[1:].long() - 1
        idx = last[torch.tensor(rows, device=self.device)] if len(rows) < meta.num_seqs else last
        return self.model.compute_logits(hidden[idx]).float()

    # ---- sizing --------------------------------------------------------------------

    @torch.inference_mode()
    def profile_peak_bytes(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """Activation peak of a forward over ``max_num_batched_tokens`` prompt tokens (CUDA).

        Uses the pool allocated at construction (keep it small) as scratch.
        """
        dev = self.device
        bs = self.block_size
        per_seq = max(1, min(max_model_len, max_num_batched_tokens,
                             self.kv_cache.num_blocks * bs))
        chunks, tables = [], []
        left = max_num_batched_tokens
        while left > 0:
            n = min(per_seq, left)
            chunks.append([0] * n)
            tables.append(list(range(-(-n // bs))))
            left -= n
        step = StepInput(chunks, [0] * len(chunks), tables, [True] * len(chunks))
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self.execute(step)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - before
