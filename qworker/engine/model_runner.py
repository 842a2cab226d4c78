"""The model runner: owns the model, the paged KV pool and the attention backend.

It holds the pool (sized by ``engine_setup``), executes block copies and swaps, and
turns a scheduled step into one forward: inputs and metadata through the persistent
buffers of ``step_inputs`` (no host-device round trip), the forward inside the step's
``forward_context``, logits only for the rows that sample.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from qworker.attention.backend import AttentionBackend, KVCache
from qworker.attention.paged_attention import (
    attention_layers,
    bind_kv_cache,
    forward_context,
    unbind_kv_cache,
)
from qworker.engine.cuda_graphs import CudaGraphRunner, GraphFactory, PlanFactory
from qworker.engine.step_inputs import PreparedStep, StepInput, StepInputBuilder
from qworker.models.base import CausalLM, ModelSpec

__all__ = ["DEFAULT_CPU_KV_MEMORY", "ModelRunner", "StepInput"]

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 1 << 30


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
        kv_dtype: torch.dtype | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.block_size = block_size
        self.backend = backend
        # the cache's element type: the model dtype, or FP8 (kv_cache_dtype, qworker.attention.fp8)
        self.kv_dtype = kv_dtype or spec.dtype
        max_len = max_model_len or spec.max_position_embeddings
        self.inputs = StepInputBuilder(device, block_size, max_num_batched_tokens,
                                       max_num_seqs, -(-max_len // block_size))
        self.graphs: CudaGraphRunner | None = None
        self.kv_cache = self._allocate(num_blocks)
        bind_kv_cache(model, self.kv_cache, backend)
        self.swap_cache: KVCache | None = None

    def _allocate(self, num_blocks: int) -> KVCache:
        spec = self.spec
        return KVCache.allocate(
            spec.num_layers, num_blocks, spec.num_kv_heads, self.block_size, spec.head_dim,
            self.kv_dtype, self.device,
        )

    def reallocate_pool(self, num_blocks: int) -> None:
        """Replace the device pool by a zeroed one of ``num_blocks`` blocks (after profiling);
        captured graphs point at the old pool and are dropped."""
        self.drop_cuda_graphs()
        unbind_kv_cache(self.model)
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
                self.kv_dtype, "cpu", pin_memory=self.device.type == "cuda",
            )

    def bytes_per_block(self) -> int:
        """Bytes one block costs across all layers, keys and values."""
        spec = self.spec
        return KVCache.bytes_per_block(
            spec.num_layers, spec.num_kv_heads, self.block_size, spec.head_dim, self.kv_dtype
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

    def enable_cuda_graphs(self, sizes: list[int], max_model_len: int,
                           graph_factory: GraphFactory | None = None) -> int:
        """Capture the decode forward for every batch size in ``sizes`` (after the pool is
        final: graphs hold its addresses); returns the device bytes they hold. Needs a
        backend with fixed decode plans (``plan_decode``: the CUDA kernels) unless a test
        passes its own ``graph_factory``; otherwise graphs stay off (logged)."""
        if not self.model.graph_capturable(self.device):
            logger.info("CUDA graphs off: the model's MoE experts take the host-synced "
                        "grouped loop on %s for %s (docs/moe.md)", self.device,
                        self.spec.dtype)
            return 0
        plans = self._plan_factory(max_model_len)
        if plans is None and graph_factory is None:
            logger.info("CUDA graphs off: attention backend %s cannot be captured",
                        self.backend.name)
            return 0
        try:
            if plans is not None:
                plans(1)
        except ValueError as exc:  # e.g. no tensor-core decode for this dtype / head size
            logger.info("CUDA graphs off: %s", exc)
            return 0
        self.graphs = CudaGraphRunner(self.model, self.inputs, sizes, max_model_len,
                                      graph_factory, plans)
        return self.graphs.capture_all()

    def _plan_factory(self, max_model_len: int) -> PlanFactory | None:
        """Per bucket size, the backend's fixed decode plan of each sliding window."""
        plan_decode = getattr(self.backend, "plan_decode", None)
        if plan_decode is None:
            return None
        spec, windows = self.spec, {a.sliding_window for a in attention_layers(self.model)}

        def make(size: int) -> dict[int | None, Any]:
            return {w: plan_decode(size, max_model_len, spec.num_q_heads, spec.num_kv_heads,
                                   spec.head_dim, spec.dtype, kv_cache_dtype=self.kv_dtype,
                                   sliding_window=w, device=self.device) for w in windows}

        return make

    def drop_cuda_graphs(self) -> None:
        """Release the captured graphs (eager forwards from now on)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def prepare(self, step: StepInput, prev_tokens: torch.Tensor | None = None) -> PreparedStep:
        """The step's device inputs (sequences ordered decodes first); see ``step_inputs``.
        A pure-decode step within the graph buckets is padded to its bucket."""
        size = self.graphs.bucket(step) if self.graphs is not None else None
        return self.inputs.build(step, prev_tokens, pad_to=size)

    def forward(self, prepared: PreparedStep) -> torch.Tensor | None:
        """Run the model (a graph replay when the step was padded to a bucket); fp32 logits
        ``[num_logit_rows, vocab]`` in row order, or None."""
        if prepared.graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(prepared)
        else:
            with forward_context(prepared.meta):
                hidden = self.model(prepared.input_ids, prepared.positions)
        if not prepared.num_logit_rows:
            return None
        if prepared.logits_index is not None:
            hidden = hidden.index_select(0, prepared.logits_index)
        return self.model.compute_logits(hidden).float()

    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """``prepare`` then ``forward``: fp32 logits of the sampling rows, in order (or None)."""
        if torch.is_inference_mode_enabled():
            return self.forward(self.prepare(step, prev_tokens))
        with torch.inference_mode():
            return self.forward(self.prepare(step, prev_tokens))

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
