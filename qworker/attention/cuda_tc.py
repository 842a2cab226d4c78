"""Launching the tensor-core attention kernels (``cuda/paged_decode_tc.cu``,
``cuda/paged_prefill_tc.cu``) for :class:`~qworker.attention.cuda_backend.CudaAttentionBackend`.

Decode: one launch per layer over every decoding sequence, grid (sequence, KV head x head
tile, split) from :func:`~qworker.attention.cuda_kernels.plan_decode_tc`; a split launch
merges its partitions in the same launch through a static workspace (partials and one
counter per sequence and head tile, left at zero by every launch). Per step the plan is
made once (cached on the step's metadata) and every layer only packs its pointers. A fixed
plan (:meth:`TcLauncher.plan_decode`, for CUDA-graph capture) sizes the grid for an upper
bound of sequences and length; its workspace is allocated when it is made and never freed,
so a captured graph can replay it while ``seq_lens`` grows.

Prefill: one launch per layer over 64-row query tiles of every prefilling sequence (rows =
token x GQA head), grid (tile, KV head); the tile table is built on the host once per step
(longest context first) and copied to the device with one transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qworker.attention.backend import AttentionMetadata
from qworker.attention.cuda_kernels import (
    DECODE_TC,
    PREFILL_TC,
    TC_MAX_SPLITS,
    DecodeTcPlan,
    plan_decode_tc,
    prefill_tc_layout,
    prefill_tc_name,
)
from qworker.attention.kernel_cache import KernelRunner, f32, i32, i64, ptr

_LOG2E = 1.0 / math.log(2.0)

#: Query rows per prefill CTA (kPrefillRows).
PREFILL_ROWS = 64


@dataclass(slots=True)
class Workspace:
    """Split-merge scratch of one device: partial outputs, (max, sum) pairs, counters."""

    work_o: torch.Tensor  # fp32, flat
    work_ml: torch.Tensor  # fp32, flat
    counters: torch.Tensor  # int32, zero between launches

    def fits(self, floats: int, counters: int) -> bool:
        """Whether this workspace serves ``floats`` partial elements and ``counters``."""
        return self.work_o.numel() >= floats and self.counters.numel() >= counters


def _workspace_for(device: torch.device, floats: int, pairs: int, counters: int) -> Workspace:
    return Workspace(
        torch.empty(max(1, floats), dtype=torch.float32, device=device),
        torch.empty(max(1, 2 * pairs), dtype=torch.float32, device=device),
        torch.zeros(max(1, counters), dtype=torch.int32, device=device),
    )


@dataclass(slots=True)
class FixedDecodePlan:
    """A decode plan for an upper bound of ``max_seqs`` sequences (CUDA graphs), with its
    own workspace. Put it in ``AttentionMetadata.decode_plan``."""

    plan: DecodeTcPlan
    max_seqs: int
    max_seq_len: int
    workspace: Workspace


class TcLauncher:
    """Packs and launches the tensor-core kernels; owns the per-device dynamic workspace."""

    def __init__(self, kernels: KernelRunner, emulated: bool) -> None:
        self._kernels = kernels
        self._emulated = emulated
        self._workspaces: dict[Any, Workspace] = {}
        self._retired: list[Workspace] = []  # outgrown ones stay alive (graphs may hold them)
        # Per-step caches hold the step's slot_mapping tensor itself (an id() could be
        # reused): every layer's metadata of one step shares it, whatever its window or
        # soft-cap (qworker.attention.paged_attention.current_metadata), and each step
        # (each CUDA-graph run too) has a new one.
        self._step: tuple[torch.Tensor, dict[Any, Any]] | None = None  # (slots, key -> launch)
        self._tiles: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self.last_decode: DecodeTcPlan | None = None

    # -- decode --------------------------------------------------------------------------

    def plan_decode(
        self,
        dtype: torch.dtype,
        kv8: bool,
        head_dim: int,
        max_seqs: int,
        num_q_heads: int,
        num_kv_heads: int,
        max_seq_len: int,
        num_sms: int,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> FixedDecodePlan:
        """A fixed plan for up to ``max_seqs`` sequences of up to ``max_seq_len`` tokens."""
        group = num_q_heads // num_kv_heads
        plan = plan_decode_tc(dtype, kv8, head_dim, max_seqs, num_kv_heads, group, max_seq_len,
                              num_sms, sliding_window, fixed=True)  # fmt: skip
        floats = max_seqs * num_q_heads * plan.num_splits * head_dim if plan.split else 0
        pairs = max_seqs * num_q_heads * plan.num_splits if plan.split else 0
        counters = max_seqs * num_kv_heads * plan.head_tiles
        ws = _workspace_for(device, floats, pairs, counters)
        return FixedDecodePlan(plan, max_seqs, max_seq_len, ws)

    def _dynamic_workspace(self, device: torch.device, floats: int, counters: int) -> Workspace:
        key = (device.type, device.index)
        ws = self._workspaces.get(key)
        if ws is None or not ws.fits(floats, counters):
            if not self._emulated and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "decode workspace must grow during CUDA-graph capture: capture with a "
                    "fixed plan (CudaAttentionBackend.plan_decode) in meta.decode_plan"
                )
            if ws is not None:
                self._retired.append(ws)
            grow = max(floats, 2 * (ws.work_o.numel() if ws else 0))
            ws = _workspace_for(device, grow, grow, max(counters, 1024))
            self._workspaces[key] = ws
        return ws

    def decode(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
        num_sms: int,
        split_k: bool | None,
        partition_size: int | None,
    ) -> None:
        """Attend the ``len(seq_lens)`` decode rows of ``query`` into ``out``.

        Everything but the layer's own pointers (query, out, caches, scales) is worked out
        once per step and (window, soft-cap, shape) and reused by every layer."""
        # id() of the fixed plan is stable: the cached launch keeps it alive
        key = (query.dtype, kv_scales is not None, query.shape, key_cache.shape, query.stride(0),
               key_cache.stride(0), block_tables.data_ptr(), seq_lens.data_ptr(), scale,
               seq_lens.shape[0], meta.max_seq_len, id(meta.decode_plan), meta.sliding_window,
               meta.logits_soft_cap)  # fmt: skip
        cached = self._step
        if cached is None or cached[0] is not meta.slot_mapping:
            cached = self._step = (meta.slot_mapping, {})
        launch = cached[1].get(key)
        if launch is None:
            launch = self._decode_launch(query, key_cache, block_tables, seq_lens, meta, scale,
                                         kv_scales is not None, num_sms, split_k,
                                         partition_size)  # fmt: skip
            cached[1][key] = (*launch, meta.decode_plan)
        plan, kernel, grid, smem, head, tail = launch[:6]
        self.last_decode = plan
        args = (
            ptr(out), *head, ptr(query), ptr(key_cache), ptr(value_cache), *tail[:2],
            ptr(kv_scales), i64(query.stride(0)), i64(out.stride(0)), *tail[2:],
        )  # fmt: skip
        self._kernels.launch(kernel, grid, (plan.warps * 32, 1, 1), args, query.device,
                             shared_mem=smem)  # fmt: skip

    def _decode_launch(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv8: bool,
        num_sms: int,
        split_k: bool | None,
        partition_size: int | None,
    ) -> tuple[Any, ...]:
        """The step's plan, kernel, grid and the argument groups shared by every layer."""
        num_seqs = seq_lens.shape[0]
        device = query.device
        _, q_heads, dim = query.shape
        _, kv_heads, block_size, _ = key_cache.shape
        fixed: FixedDecodePlan | None = meta.decode_plan
        if fixed is not None:
            if num_seqs > fixed.max_seqs:
                raise ValueError(f"{num_seqs} decodes exceed the fixed plan's {fixed.max_seqs}")
            plan, ws = fixed.plan, fixed.workspace
        else:
            if not self._emulated and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "decode launched during CUDA-graph capture without a fixed plan: set "
                    "meta.decode_plan = CudaAttentionBackend.plan_decode(...)"
                )
            group = q_heads // kv_heads
            plan = plan_decode_tc(query.dtype, kv8, dim, num_seqs, kv_heads, group,
                                  meta.max_seq_len, num_sms, meta.sliding_window, split_k,
                                  partition_size)  # fmt: skip
            ws = None
            if plan.split:
                floats = num_seqs * q_heads * plan.num_splits * dim
                ws = self._dynamic_workspace(device, floats, num_seqs * kv_heads * plan.head_tiles)
        assert plan.num_splits <= TC_MAX_SPLITS
        kernel = self._kernels.get(DECODE_TC, plan.kernel_name(meta.logits_soft_cap is not None),
                                   device)
        grid = (num_seqs, kv_heads * plan.head_tiles, plan.num_splits)
        head = (ptr(ws.work_o if ws else None), ptr(ws.work_ml if ws else None),
                ptr(ws.counters if ws else None))  # fmt: skip
        tail = (
            ptr(block_tables), ptr(seq_lens), i32(block_tables.stride(0)), i32(kv_heads),
            i32(q_heads // kv_heads), i32(plan.head_tiles), i64(key_cache.stride(0)),
            i64(key_cache.stride(1)), i32(block_size.bit_length() - 1), f32(scale * _LOG2E),
            i32(meta.sliding_window or 0), i32(plan.partition_size),
            f32((meta.logits_soft_cap or 0.0) * _LOG2E),
        )  # fmt: skip
        return plan, kernel, grid, plan.smem_bytes, head, tail

    # -- prefill -------------------------------------------------------------------------

    def prefill_tiles(
        self, meta: AttentionMetadata, starts: list[int], lens: list[int], group: int,
        device: torch.device,
    ) -> torch.Tensor:  # fmt: skip
        """The step's ``[tiles, 2]`` int32 table (sequence, first row), longest context
        first, on ``device`` (built once per step)."""
        cached = self._tiles
        if cached is not None and cached[0] is meta.slot_mapping and cached[1] == group:
            return cached[2]
        first = meta.num_decodes
        seqs = np.arange(first, meta.num_seqs)
        q_lens = np.asarray(starts[first + 1 : meta.num_seqs + 1]) - np.asarray(
            starts[first : meta.num_seqs]
        )
        rows = q_lens * group
        counts = (rows + PREFILL_ROWS - 1) // PREFILL_ROWS
        seq_of = np.repeat(seqs, counts)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        row0 = (np.arange(counts.sum()) - first_tile) * PREFILL_ROWS
        past = np.asarray(lens, dtype=np.int64)[seq_of] - np.repeat(q_lens, counts)
        last = np.minimum(row0 + PREFILL_ROWS, np.repeat(rows, counts)) - 1
        order = np.argsort(-(past + last // group), kind="stable")
        table = np.stack([seq_of[order], row0[order]], axis=1).astype(np.int32)
        tiles = torch.from_numpy(np.ascontiguousarray(table)).to(device)
        self._tiles = (meta.slot_mapping, group, tiles)
        return tiles

    def prefill(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        meta: AttentionMetadata,
        starts: list[int],
        lens: list[int],
        scale: float,
        kv_scales: torch.Tensor | None,
    ) -> None:
        """Attend every prefill row (sequences past ``meta.num_decodes``) into ``out``."""
        device = query.device
        _, q_heads, dim = query.shape
        _, kv_heads, block_size, _ = key_cache.shape
        group = q_heads // kv_heads
        tiles = self.prefill_tiles(meta, starts, lens, group, device)
        if tiles.shape[0] == 0:
            return
        kv8 = kv_scales is not None
        layout = prefill_tc_layout(kv8, dim)
        name = prefill_tc_name(query.dtype, kv8, dim, capped=meta.logits_soft_cap is not None)
        kernel = self._kernels.get(PREFILL_TC, name, device)
        seq_lens = meta.seq_lens if meta.seq_lens.dtype == torch.int32 else meta.seq_lens.int()
        qsl = meta.query_start_loc
        if qsl.dtype != torch.int32:
            qsl = qsl.int()
        args = (
            ptr(out), ptr(query), ptr(key_cache), ptr(value_cache), ptr(block_tables),
            ptr(seq_lens), ptr(qsl), ptr(tiles), ptr(kv_scales),
            i64(query.stride(0)), i64(out.stride(0)), i32(block_tables.stride(0)),
            i32(kv_heads), i32(group), i64(key_cache.stride(0)), i64(key_cache.stride(1)),
            i32(block_size.bit_length() - 1), f32(scale * _LOG2E), i32(meta.sliding_window or 0),
            f32((meta.logits_soft_cap or 0.0) * _LOG2E),
        )  # fmt: skip
        self._kernels.launch(kernel, (tiles.shape[0], kv_heads, 1), (128, 1, 1), args, device,
                             shared_mem=layout.smem_bytes)  # fmt: skip
