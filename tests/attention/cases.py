"""Random paged-attention batches for comparing a backend with the torch reference.

Every slot of the pool that holds no token of any sequence is NaN (block 0, the padding
target of block tables, included), so a kernel reading past a sequence's context, a wrong
block or a padding block turns its output into NaN instead of a small error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qworker.attention.backend import AttentionMetadata


@dataclass(slots=True)
class Batch:
    """One step's inputs: query, one layer's paged cache, metadata, the new tokens' K/V."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    new_key: torch.Tensor
    new_value: torch.Tensor


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    sliding_window: int | None = None,
    seed: int = 0,
    spare_blocks: int = 3,
    pad_tokens: int = 0,
    logits_soft_cap: float | None = None,
) -> Batch:
    """A batch of sequences (decodes, query length 1, must come first) whose contexts are
    already in the cache, scattered over a randomly permuted pool.

    ``pad_tokens`` padding rows (slot -1) follow the real tokens; ``logits_soft_cap`` goes
    into the metadata as a soft-capped layer's would.
    """
    assert len(q_lens) == len(seq_lens)
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    num_decodes = 0
    while num_decodes < n and q_lens[num_decodes] == 1:
        num_decodes += 1
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks  # block 0 is never assigned
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(blocks_per_seq) + 2
    tables = torch.zeros(n, width, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    # the pool is drawn where it lives: large pools on a GPU would be slow to draw on the host
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    key_cache = torch.randn(shape, generator=dev_gen, device=device)
    value_cache = torch.randn(shape, generator=dev_gen, device=device)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    k = 0
    for s, length in enumerate(seq_lens):
        nb = blocks_per_seq[s]
        tables[s, :nb] = torch.tensor(perm[k : k + nb], dtype=torch.int32)
        k += nb
        pos = torch.arange(length)
        used[tables[s, pos // block_size].long(), pos % block_size] = True
    # [blocks, heads, B, D] -> [blocks, B, heads, D] so the [blocks, B] mask selects rows
    unused = (~used).to(device)
    key_cache.transpose(1, 2)[unused] = float("nan")
    value_cache.transpose(1, 2)[unused] = float("nan")
    slots: list[int] = []
    for s, (q_len, length) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(length - q_len, length):
            slots.append(int(tables[s, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * pad_tokens
    num_tokens = len(slots)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    new_key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    new_value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        num_seqs=n,
        num_tokens=num_tokens,
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    return Batch(
        query=query.to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        meta=meta,
        new_key=new_key.to(device=device, dtype=dtype),
        new_value=new_value.to(device=device, dtype=dtype),
    )


#: Relative error bounds per dtype (output rounding dominates; see METHOD.md).
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 1.5e-2,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor, rows: slice | None = None) -> float:
    """``||out - ref|| / ||ref||`` in float64 over ``rows``; inf when anything is NaN."""
    if rows is not None:
        out, ref = out[rows], ref[rows]
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
