"""The pure-torch paged attention: gather each sequence's context, then attend.

It is the oracle every other backend is tested against and the CPU path, so it
favours plainness over speed: per sequence, gather the blocks named by the block
table into a contiguous ``[context, kv_heads, head_dim]`` tensor and run a causal
softmax attention in fp32 (scores soft-capped first when the layer's metadata asks,
``cap * tanh(s / cap)`` as transformers' Gemma 2 does, then masked by causality and
the sliding window). It runs on any device torch supports. An FP8 cache
(:mod:`qworker.attention.fp8`) is written with :func:`~qworker.attention.fp8.quantize`
and read back times its scales, in fp32.
"""

from __future__ import annotations

import torch

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from qworker.attention.fp8 import is_fp8, quantize, resolve_scales


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention and cache operations written with plain torch ops."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Scatter new K/V rows into their slots, skipping padding slots (-1)."""
        if is_fp8(key_cache.dtype):
            scales, pool, layer = resolve_scales(key_cache, kv_scales)
            if pool is not None:
                pool.calibrate(layer, key, value, slot_mapping)
            key, value = quantize(key, scales[0]), quantize(value, scales[1])
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        block_size = key_cache.shape[2]
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping % block_size
        key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
        value_cache[blocks, :, offsets] = value.to(value_cache.dtype)

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's query rows over its whole cached context."""
        k_scale = v_scale = None
        if is_fp8(key_cache.dtype):
            scales = resolve_scales(key_cache, kv_scales)[0]
            k_scale, v_scale = scales[0], scales[1]
        out = torch.empty_like(query)
        block_size = key_cache.shape[2]
        num_q_heads = query.shape[1]
        num_kv_heads = key_cache.shape[1]
        group = num_q_heads // num_kv_heads
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for s in range(meta.num_seqs):
            q0, q1 = starts[s], starts[s + 1]
            if q1 == q0:
                continue
            seq_len = seq_lens[s]
            num_blocks = (seq_len + block_size - 1) // block_size
            table = meta.block_tables[s, :num_blocks].long()
            # [blocks, heads, B, D] -> [heads, blocks*B, D] -> first seq_len tokens
            k = key_cache[table].transpose(0, 1).reshape(num_kv_heads, -1, key_cache.shape[3])
            v = value_cache[table].transpose(0, 1).reshape(num_kv_heads, -1, value_cache.shape[3])
            k = k[:, :seq_len].float().repeat_interleave(group, dim=0)
            v = v[:, :seq_len].float().repeat_interleave(group, dim=0)
            if k_scale is not None:
                k, v = k * k_scale, v * v_scale
            q = query[q0:q1].float().transpose(0, 1)  # [heads, q_len, D]
            scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [heads, q_len, seq_len]
            cap = meta.logits_soft_cap
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            q_len = q1 - q0
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
            mask = k_pos > q_pos
            if meta.sliding_window is not None:
                mask |= k_pos <= q_pos - meta.sliding_window
            scores.masked_fill_(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q0:q1] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
        return out

    def copy_blocks(self, kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks within the pool, all layers at once."""
        for pool in (_bytes(kv_cache.key), _bytes(kv_cache.value)):
            pool[:, dst] = pool[:, src]

    def swap_blocks(
        self, src_cache: KVCache, dst_cache: KVCache, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy blocks between two pools, possibly on different devices."""
        device = dst_cache.key.device
        src_idx = src.to(src_cache.key.device)
        dst_idx = dst.to(device)
        # Only a copy *into* the GPU may be asynchronous: a device-to-host copy must land
        # before the host-side scatter reads it.
        nb = device.type == "cuda"
        for s_pool, d_pool in ((src_cache.key, dst_cache.key), (src_cache.value, dst_cache.value)):
            _bytes(d_pool)[:, dst_idx] = _bytes(s_pool)[:, src_idx].to(device, non_blocking=nb)


def _bytes(pool: torch.Tensor) -> torch.Tensor:
    """An FP8 pool as uint8 (torch lacks some indexing kernels for float8); others as is."""
    return pool.view(torch.uint8) if is_fp8(pool.dtype) else pool
