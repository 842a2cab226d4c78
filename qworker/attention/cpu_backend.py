"""Batched paged attention for the CPU: every sequence of a step in one attention call.

The torch reference (``torch_ref.py``) loops over sequences in Python, which is most of
a CPU step on small models. Here each layer makes at most two attention calls per step,
one for all decodes and one for all prefill chunks: the step's contexts are gathered
from the pool with one ``index_select`` per K and V (blocks named by the block table,
padded to the longest context of the group), and a boolean mask built once per step
(per sliding window) hides padding, future tokens and what falls outside a window.
Padding query rows of the prefill group repeat their sequence's last row and are
dropped. Softmax and accumulation run in fp32 (inputs of other dtypes are upcast),
as the backend contract asks (``qworker/attention/backend.py``).

Everything derived from the step's metadata (gather indices, masks, row maps) is
computed at the first layer and reused by the others; nothing reads tensor values
back into Python during the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qworker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from qworker.attention.torch_ref import TorchAttentionBackend


@dataclass(slots=True)
class _Group:
    """One attention call: ``num_seqs`` sequences padded to ``q_len`` x ``ctx_len``."""

    block_rows: torch.Tensor  # int64 [num_seqs * num_blocks] block ids to gather
    num_seqs: int
    num_blocks: int
    mask: torch.Tensor  # bool [num_seqs, 1, q_len, num_blocks * block_size], True = attend
    live: torch.Tensor  # bool [num_seqs, 1, num_blocks, block_size, 1]: slot holds a token
    q_index: torch.Tensor | None  # int64 [num_seqs, q_len] query rows (None: decodes)
    out_index: torch.Tensor | None  # int64 [n] flat padded rows holding real tokens
    out_rows: slice | torch.Tensor  # where those rows go in the step's output


@dataclass(slots=True)
class _Plan:
    groups: list[_Group]


def _live(seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[S, 1, num_blocks, block_size, 1]: which gathered slots hold one of the sequence's
    tokens (the rest is padding or stale data and is zeroed, so a non-finite value left
    in a free block cannot reach the output through a masked-out position)."""
    pos = torch.arange(num_blocks * block_size).view(1, 1, num_blocks, block_size, 1)
    return pos < seq_lens.view(-1, 1, 1, 1, 1)


def _causal_mask(k_len: int, seq_lens: torch.Tensor, q_pos: torch.Tensor,
                 window: int | None) -> torch.Tensor:
    """[S, 1, Q, k_len]: key ``j`` visible to query position ``q_pos[s, r]``."""
    k_pos = torch.arange(k_len).view(1, 1, k_len)
    q = q_pos.unsqueeze(2)
    mask = (k_pos <= q) & (k_pos < seq_lens.view(-1, 1, 1))
    if window is not None:
        mask &= k_pos > q - window
    return mask.unsqueeze(1)


class CpuAttentionBackend(AttentionBackend):
    """Paged attention with one batched SDPA call per sequence group (decodes, prefills).

    Runs on any device torch supports but is meant for the CPU: its padding and
    masking trade FLOPs for fewer, larger ops, which is the right trade there.
    """

    name = "cpu"

    def __init__(self) -> None:
        self._ref = TorchAttentionBackend()
        self._step: torch.Tensor | None = None  # the slot_mapping the plans below belong to
        self._plans: dict[tuple[int | None, int], _Plan] = {}
        self._slots: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor] | None
        self._slots = None

    # ---- cache writes ----------------------------------------------------------------

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter new K/V rows into their slots; padding slots (-1) are skipped."""
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

    def _build_plan(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        starts = meta.query_start_loc_cpu
        lens = meta.seq_lens_cpu
        if starts is None or lens is None:
            starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        tables = meta.block_tables.to(torch.int64)
        groups: list[_Group] = []
        nd = meta.num_decodes
        window = meta.sliding_window
        if nd:
            max_len = max(lens[:nd])
            nb = -(-max_len // block_size)
            seq_lens = torch.tensor(lens[:nd])
            mask = _causal_mask(nb * block_size, seq_lens, (seq_lens - 1).view(nd, 1), window)
            groups.append(_Group(tables[:nd, :nb].reshape(-1), nd, nb, mask,
                                 _live(seq_lens, nb, block_size), None, None, slice(0, nd)))
        num_prefills = meta.num_seqs - nd
        if num_prefills:
            q_lens = [starts[s + 1] - starts[s] for s in range(nd, meta.num_seqs)]
            p_lens = lens[nd:]
            q_max, max_len = max(q_lens), max(p_lens)
            nb = -(-max_len // block_size)
            r = torch.arange(q_max).view(1, q_max)
            q_len_t = torch.tensor(q_lens).view(-1, 1)
            seq_lens = torch.tensor(p_lens)
            rr = torch.minimum(r, q_len_t - 1)  # padding rows repeat the last real row
            q_index = torch.tensor(starts[nd:-1]).view(-1, 1) + rr
            q_pos = seq_lens.view(-1, 1) - q_len_t + rr
            mask = _causal_mask(nb * block_size, seq_lens, q_pos, window)
            real = (r < q_len_t).reshape(-1).nonzero().squeeze(1)
            groups.append(_Group(tables[nd:meta.num_seqs, :nb].reshape(-1), num_prefills, nb,
                                 mask, _live(seq_lens, nb, block_size), q_index, real,
                                 slice(starts[nd], starts[-1])))
        return _Plan(groups)

    def _gather(self, cache: torch.Tensor, group: _Group, dtype: torch.dtype) -> torch.Tensor:
        _, heads, block_size, dim = cache.shape
        blocks = cache.index_select(0, group.block_rows)
        blocks = blocks.view(group.num_seqs, group.num_blocks, heads, block_size, dim)
        if blocks.dtype != dtype:
            blocks = blocks.to(dtype)
        # One pass both reorders to [S, heads, tokens, D] and zeroes the dead slots.
        ctx = torch.empty((group.num_seqs, heads, group.num_blocks, block_size, dim),
                          dtype=dtype, device=cache.device)
        torch.where(group.live, blocks.transpose(1, 2), blocks.new_zeros(()), out=ctx)
        return ctx.view(group.num_seqs, heads, -1, dim)

    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of every query row over its sequence's cached context."""
        block_size = key_cache.shape[2]
        if self._step is not meta.slot_mapping:
            self._step, self._plans = meta.slot_mapping, {}
        plan = self._plans.get((meta.sliding_window, block_size))
        if plan is None:
            plan = self._build_plan(meta, block_size)
            self._plans[(meta.sliding_window, block_size)] = plan
        dtype = torch.float32
        out = torch.empty_like(query)
        heads_per_kv = query.shape[1] // key_cache.shape[1]
        for group in plan.groups:
            k = self._gather(key_cache, group, dtype)
            v = self._gather(value_cache, group, dtype)
            if group.q_index is None:
                q = query[group.out_rows].unsqueeze(2)  # [S, Hq, 1, D]
            else:
                q = query[group.q_index].transpose(1, 2)  # [S, Hq, Q, D]
            if q.dtype != dtype:
                q = q.to(dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale,
                                               enable_gqa=heads_per_kv > 1)
            o = o.transpose(1, 2)  # [S, Q, Hq, D]
            if group.out_index is None:
                out[group.out_rows] = o.squeeze(1).to(out.dtype)
            else:
                flat = o.reshape(-1, o.shape[2], o.shape[3])
                out[group.out_rows] = flat.index_select(0, group.out_index).to(out.dtype)
        return out

    # ---- block movement (plain torch, as the reference) -------------------------------

    def copy_blocks(self, kv_cache: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks within the pool, all layers at once."""
        self._ref.copy_blocks(kv_cache, src, dst)

    def swap_blocks(self, src_cache: KVCache, dst_cache: KVCache, src: torch.Tensor,
                    dst: torch.Tensor) -> None:
        """Copy blocks between two pools."""
        self._ref.swap_blocks(src_cache, dst_cache, src, dst)
