"""Batched paged attention for the CPU: all of a step's decodes in one attention call.

The torch reference (``torch_ref.py``) loops over sequences in Python, which is most of
a CPU step on small models. Here every decode of a step is attended in one pass per
layer, straight over the pages, with no padding of keys and values:

* the blocks of every decoding sequence are gathered with one ``index_select`` per K
  and V (``[N, heads, block_size, D]``, N = the step's decode blocks, only those a
  sliding window can still see);
* one batched matmul scores each block against its sequence's query rows (soft-capped,
  ``cap * tanh(s / cap)``, for layers whose metadata carries a cap);
* the softmax runs over each sequence's blocks (the per-block maxima meet in a small
  padded ``[S, max_blocks]`` layout);
* one batched matmul applies the probabilities to each block's values, and an
  ``index_add_`` sums the blocks of each sequence.

With fp32 caches and the CPU kernels built (``qworker.cpu_kernels``), the decodes go
through ``decode_attention.c`` instead: one task per (sequence, KV head) straight over
the pages, no gather, on the kernels' thread pool; the torch form above is the fallback.

Prefill chunks (a few per step, long queries) go through torch SDPA over their
gathered context (``qworker.attention.sdpa_prefill``), FlashAttention-style on CPU.
Everything derived from the step's metadata (block lists, masks, row maps) is built
at the first layer and reused by the others (per sliding window); nothing reads
device tensors back during the forward when the runner supplies the host copies of
``query_start_loc``/``seq_lens``. Softmax and accumulation run in fp32, as the
backend contract asks (``qworker/attention/backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qworker import cpu_kernels
from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from qworker.attention.fp8 import is_fp8
from qworker.attention.sdpa_prefill import sdpa_prefill
from qworker.attention.torch_ref import TorchAttentionBackend


@dataclass(slots=True)
class _DecodePlan:
    """The step's decodes as a flat list of ``N`` blocks (see the module docstring)."""

    blocks: torch.Tensor  # int64 [N] block ids, each sequence's blocks in order
    block_seq: torch.Tensor  # int64 [N] which decode each block belongs to
    pad_index: torch.Tensor  # int64 [N] row of each block in the [S * max_blocks] layout
    dead: torch.Tensor  # bool [N, 1, 1, B]: slot empty, in the future or out of window
    last: torch.Tensor  # int64 [S] each sequence's last block (its only partial one)
    last_live: torch.Tensor  # bool [S, 1, B, 1]: slots of that block holding tokens
    num_seqs: int
    max_blocks: int


@dataclass(slots=True)
class _Plan:
    decode: _DecodePlan | None  # the torch form's plan
    decode_lens: torch.Tensor | None  # int64 [num_decodes]: the kernel's
    starts: list[int]
    lens: list[int]


def _decode_plan(tables: torch.Tensor, lens: list[int], block_size: int,
                 window: int | None) -> _DecodePlan:
    """Block lists, masks and row maps of ``len(lens)`` decodes (host ints in ``lens``)."""
    num_seqs = len(lens)
    last_block = [(n - 1) // block_size for n in lens]
    first_block = [0] * num_seqs
    if window is not None:  # blocks wholly before the window are never read
        first_block = [max(0, n - window) // block_size for n in lens]
    counts = [b - a + 1 for a, b in zip(first_block, last_block, strict=True)]
    max_blocks = max(counts)
    counts_t = torch.tensor(counts)
    block_seq = torch.repeat_interleave(torch.arange(num_seqs), counts_t)
    offsets = torch.cumsum(counts_t, 0) - counts_t  # first flat row of each sequence
    j = torch.arange(int(block_seq.shape[0])) - offsets[block_seq]  # block number within
    col = torch.tensor(first_block)[block_seq] + j
    blocks = tables[block_seq, col].to(torch.int64)
    pos = col.view(-1, 1) * block_size + torch.arange(block_size).view(1, -1)
    seq_len = torch.tensor(lens)[block_seq].view(-1, 1)
    dead = pos >= seq_len
    if window is not None:
        dead |= pos <= seq_len - 1 - window
    fill = torch.tensor([n - b * block_size for n, b in zip(lens, last_block, strict=True)])
    last_live = torch.arange(block_size).view(1, -1) < fill.view(-1, 1)
    return _DecodePlan(
        blocks=blocks, block_seq=block_seq, pad_index=block_seq * max_blocks + j,
        dead=dead.view(-1, 1, 1, block_size), last=offsets + counts_t - 1,
        last_live=last_live.view(num_seqs, 1, block_size, 1), num_seqs=num_seqs,
        max_blocks=max_blocks)


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            plan: _DecodePlan, scale: float, out: torch.Tensor,
            soft_cap: float | None = None) -> None:
    """Attention of the first ``plan.num_seqs`` query rows (one per decode) into ``out``."""
    num_seqs, heads, dim = plan.num_seqs, key_cache.shape[1], key_cache.shape[3]
    group = query.shape[1] // heads
    fp32 = torch.float32
    k = key_cache.index_select(0, plan.blocks)  # [N, H, B, D]
    v = value_cache.index_select(0, plan.blocks)
    if k.dtype != fp32:
        k, v = k.to(fp32), v.to(fp32)
    # Empty slots of a sequence's last block may hold anything (a freed block's old
    # content): zero them so that probability 0 times a non-finite value cannot occur.
    v.index_copy_(0, plan.last, torch.where(plan.last_live, v.index_select(0, plan.last),
                                            v.new_zeros(())))
    q = query[:num_seqs].to(fp32).view(num_seqs, heads, group, dim)
    scores = torch.matmul(q.index_select(0, plan.block_seq), k.transpose(-1, -2))
    scores.mul_(scale)
    if soft_cap is not None:
        scores.div_(soft_cap).tanh_().mul_(soft_cap)
    scores.masked_fill_(plan.dead, float("-inf"))  # [N, H, G, B]
    # Softmax over each sequence's blocks: per-block maxima, their per-sequence maximum
    # (through a small [S, max_blocks] layout), then unnormalised weights and sums.
    block_max = scores.amax(dim=-1)  # [N, H, G]
    padded = block_max.new_full((num_seqs * plan.max_blocks, heads, group), float("-inf"))
    padded.index_copy_(0, plan.pad_index, block_max)
    top = padded.view(num_seqs, plan.max_blocks, heads, group).amax(dim=1)  # [S, H, G]
    weights = torch.exp(scores - top.index_select(0, plan.block_seq).unsqueeze(-1))
    total = weights.new_zeros((num_seqs, heads, group))
    total.index_add_(0, plan.block_seq, weights.sum(dim=-1))
    acc = weights.new_zeros((num_seqs, heads, group, dim))
    acc.index_add_(0, plan.block_seq, torch.matmul(weights, v))  # per block [N, H, G, D]
    acc /= total.unsqueeze(-1)
    out[:num_seqs] = acc.view(num_seqs, heads * group, dim).to(out.dtype)


class CpuAttentionBackend(AttentionBackend):
    """Paged attention with every decode of a step in one batched pass per layer and
    prefill chunks through SDPA. Runs on any device torch supports; built for the CPU."""

    name = "cpu"

    def __init__(self, use_kernels: bool = True) -> None:
        """``use_kernels``: decode fp32 caches through ``qworker.cpu_kernels`` when they
        build here (False: always the torch form)."""
        self._kernels = cpu_kernels.load() if use_kernels else None
        self._ref = TorchAttentionBackend()
        self._step: torch.Tensor | None = None  # the slot_mapping the plans below belong to
        self._plans: dict[tuple[int | None, int], _Plan] = {}
        self._slots: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor] | None
        self._slots = None

    # ---- cache writes ----------------------------------------------------------------

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        """Scatter new K/V rows into their slots; padding slots (-1) are skipped. An FP8
        cache goes through the reference (quantization and calibration live there)."""
        if is_fp8(key_cache.dtype):
            return self._ref.write_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales)
        cached = self._slots
        block_size = key_cache.shape[2]
        if cached is None or cached[0] is not slot_mapping or cached[1] != block_size:
            rows = (slot_mapping >= 0).nonzero().squeeze(1)
            slots = slot_mapping.index_select(0, rows)
            cached = (slot_mapping, block_size, rows,
                      torch.div(slots, block_size, rounding_mode="floor"), slots % block_size)
            self._slots = cached
        _, _, rows, blocks, offsets = cached
        if rows.shape[0] != key.shape[0]:
            key, value = key.index_select(0, rows), value.index_select(0, rows)
        key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value.to(value_cache.dtype)

    # ---- attention ---------------------------------------------------------------------

    def _build_plan(self, meta: AttentionMetadata, block_size: int, kernel: bool) -> _Plan:
        starts, lens = meta.host_query_start_loc, meta.host_seq_lens
        starts = meta.query_start_loc.tolist() if starts is None else list(starts)
        lens = meta.seq_lens.tolist() if lens is None else list(lens)
        decode = decode_lens = None
        if meta.num_decodes and kernel:
            decode_lens = torch.tensor(lens[: meta.num_decodes], dtype=torch.int64)
        elif meta.num_decodes:
            decode = _decode_plan(meta.block_tables, lens[: meta.num_decodes], block_size,
                                  meta.sliding_window)
        return _Plan(decode, decode_lens, starts, lens)

    def _decode_kernel(self, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, meta: AttentionMetadata, lens: torch.Tensor,
                       scale: float, out: torch.Tensor) -> None:
        """The first ``len(lens)`` query rows through ``decode_attention.c`` into ``out``."""
        assert self._kernels is not None
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.to(torch.int32).contiguous()
        heads, dim = query.shape[1], query.shape[2]
        kc, vc = key_cache, value_cache
        self._kernels.lib.qw_decode_attention(
            query.data_ptr(), query.stride(0), query.stride(1),
            kc.data_ptr(), kc.stride(0), kc.stride(1), kc.stride(2),
            vc.data_ptr(), vc.stride(0), vc.stride(1), vc.stride(2),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            lens.shape[0], heads, kc.shape[1], dim, kc.shape[2], meta.sliding_window or 0,
            scale, meta.logits_soft_cap or 0.0, out.data_ptr(), out.stride(0), out.stride(1))

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of every query row over its sequence's cached context (an FP8
        cache through the reference, which dequantizes)."""
        if is_fp8(key_cache.dtype):
            return self._ref.forward(query, key_cache, value_cache, meta, scale, kv_scales)
        block_size = key_cache.shape[2]
        if self._step is not meta.slot_mapping:
            self._step, self._plans = meta.slot_mapping, {}
        kernel = (self._kernels is not None and key_cache.dtype == torch.float32
                  and query.dtype == torch.float32 and query.stride(2) == 1
                  and key_cache.stride(3) == 1 and value_cache.stride(3) == 1)
        key = (meta.sliding_window, block_size, kernel)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._build_plan(meta, block_size, kernel)
        out = torch.empty_like(query)
        if plan.decode_lens is not None:
            self._decode_kernel(query, key_cache, value_cache, meta, plan.decode_lens, scale,
                                out)
        elif plan.decode is not None:
            _decode(query, key_cache, value_cache, plan.decode, scale, out,
                    meta.logits_soft_cap)
        if meta.num_decodes < meta.num_seqs:
            if key_cache.dtype != torch.float32:  # the contract's fp32 softmax/accumulation
                out32 = out.float()
                sdpa_prefill(query.float(), key_cache, value_cache, meta.block_tables,
                             plan.starts, plan.lens, meta.num_decodes, scale, out32,
                             meta.sliding_window, soft_cap=meta.logits_soft_cap)
                first = plan.starts[meta.num_decodes]
                out[first:] = out32[first:].to(out.dtype)
            else:
                sdpa_prefill(query, key_cache, value_cache, meta.block_tables, plan.starts,
                             plan.lens, meta.num_decodes, scale, out, meta.sliding_window,
                             soft_cap=meta.logits_soft_cap)
        return out

    # ---- block movement (plain torch, as the reference) -------------------------------

    def copy_blocks(self, kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks within the pool, all layers at once."""
        self._ref.copy_blocks(kv_cache, src, dst)

    def swap_blocks(self, src_cache: KVCache, dst_cache: KVCache, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """Copy blocks between two pools."""
        self._ref.swap_blocks(src_cache, dst_cache, src, dst)
