"""Prefill-only attention over packed variable-length inputs (the embedding models).

An embedding step runs several inputs of different lengths at once with no KV cache.
Their tokens are packed end to end (``PackedBatch``: ``cu_seqlens`` and per-token
segment ids and positions), so every matmul and norm runs over real tokens only, with
no padding. Only attention needs each input apart: the inputs (given shortest first) are
cut into a few groups of similar length, and per group ``PackedAttention`` scatters q/k/v
into a padded ``[inputs, heads, max_len, head_dim]`` view with one ``index_copy`` each,
runs torch SDPA once (a key-padding mask for encoders, ``is_causal`` for decoders, the
fused kernels on a GPU), and gathers the real rows back. Padding thus costs only in
attention, and only up to the group's longest input (docs/embeddings.md, "Packing", has
the measurements that chose this over padding everything, over one block-diagonal mask
over all tokens, and over one padded group per step).

Models whose attention modules are called without the step (the decoder stack built
for paged attention) find it through ``packed_context``, a thread-local like
``qworker.attention.paged_attention.forward_context``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: An input joins the attention group of shorter inputs while it is at most this many
#: times the group's shortest (or only ``GROUP_SLACK`` tokens longer): SDPA then pads each
#: group to its own longest input, not the step's (docs/embeddings.md, "Packing").
GROUP_RATIO = 2.0
GROUP_SLACK = 16


@dataclass(slots=True)
class AttentionGroup:
    """Inputs of similar length that attend in one padded SDPA call.

    Tokens ``start:end`` of the step (the group's inputs are consecutive), ``num_seqs``
    inputs padded to ``max_len``; ``padded_index`` ``[end - start]``: each token's row in
    the group's ``[num_seqs * max_len]`` layout; ``key_mask`` bool
    ``[num_seqs, 1, 1, max_len]`` (True: a real key).
    """

    start: int
    end: int
    num_seqs: int
    max_len: int
    padded_index: torch.Tensor
    key_mask: torch.Tensor


@dataclass(slots=True)
class PackedBatch:
    """The layout of one step's packed inputs (every tensor on the model's device).

    ``cu_seqlens`` int64 ``[n + 1]`` (input ``i`` is tokens ``cu[i]:cu[i+1]``),
    ``lengths`` ``[n]``, ``seq_ids`` and ``positions`` ``[T]`` (the input of each token
    and its position in it), ``groups``: the attention groups covering the inputs in
    order (inputs given shortest first make the fewest, tightest groups).
    """

    cu_seqlens: torch.Tensor
    lengths: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    groups: list[AttentionGroup]
    num_tokens: int

    @property
    def num_seqs(self) -> int:
        """How many inputs the step packs."""
        return int(self.lengths.shape[0])

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> PackedBatch:
        """The layout of inputs of ``lengths`` tokens (each >= 1): per-token metadata with
        tensor ops, attention groups from a walk over the inputs (not the tokens)."""
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        total = int(cu[-1])
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        positions = torch.arange(total) - cu[:-1].index_select(0, seq_ids)
        bounds, low, high = [0], lengths[0], lengths[0]
        for i, n in enumerate(lengths[1:], 1):
            low2, high2 = min(low, n), max(high, n)
            if high2 > low2 * GROUP_RATIO and high2 > low2 + GROUP_SLACK:
                bounds.append(i)
                low2 = high2 = n
            low, high = low2, high2
        bounds.append(len(lengths))
        groups = []
        for a, b in itertools.pairwise(bounds):
            glens = lens[a:b]
            max_len = int(glens.max())
            start, end = int(cu[a]), int(cu[b])
            padded = (seq_ids[start:end] - a) * max_len + positions[start:end]
            mask = (torch.arange(max_len).unsqueeze(0) < glens.unsqueeze(1))[:, None, None, :]
            groups.append(AttentionGroup(start, end, b - a, max_len, padded.to(device),
                                         mask.to(device)))
        return cls(cu.to(device), lens.to(device), seq_ids.to(device), positions.to(device),
                   groups, total)


class _State(threading.local):
    batch: PackedBatch | None = None


_STATE = _State()


@contextlib.contextmanager
def packed_context(batch: PackedBatch) -> Iterator[PackedBatch]:
    """Make ``batch`` the layout every ``PackedAttention`` of this thread attends over
    until the block ends (contexts nest)."""
    saved, _STATE.batch = _STATE.batch, batch
    try:
        yield batch
    finally:
        _STATE.batch = saved


class PackedAttention(nn.Module):
    """Attention of each packed input over its own tokens, all inputs in one SDPA call.

    ``causal``: decoders see only earlier tokens; encoders every token of their input.
    ``sliding_window`` (decoders): keys more than ``window - 1`` positions back are not
    seen. The same call signature as ``PagedAttention`` (q, k, v -> out), so it replaces
    it in a decoder built for paged attention. Holds no parameters.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 causal: bool, sliding_window: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.causal = causal
        self.sliding_window = sliding_window

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                batch: PackedBatch | None = None) -> torch.Tensor:
        """``query`` ``[T, Hq * D]`` (or ``[T, Hq, D]``), ``key``/``value`` ``[T, Hkv * D]``
        over ``batch`` (default: the one ``packed_context`` set); returns ``[T, Hq * D]``."""
        batch = batch if batch is not None else _STATE.batch
        if batch is None:
            raise RuntimeError("PackedAttention called without a PackedBatch "
                               "(pass one, or run the forward inside packed_context())")
        if len(batch.groups) == 1:
            return self._attend(query, key, value, batch.groups[0])
        out = query.new_empty(query.shape[0], self.num_heads * self.head_dim)
        for g in batch.groups:  # a few groups of similar lengths, never one per input
            out[g.start:g.end] = self._attend(query[g.start:g.end], key[g.start:g.end],
                                              value[g.start:g.end], g)
        return out

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                group: AttentionGroup) -> torch.Tensor:
        """Attention of one group's tokens (``[T_g, ...]``); returns ``[T_g, Hq * D]``."""
        n, length = group.num_seqs, group.max_len
        shapes = ((self.num_heads, query), (self.num_kv_heads, key), (self.num_kv_heads, value))
        if n == 1:  # one input: no padding at all
            q, k, v = (t.reshape(1, -1, h, self.head_dim).transpose(1, 2) for h, t in shapes)
        else:
            q, k, v = (self._padded(t.reshape(-1, h, self.head_dim), group, h)
                       for h, t in shapes)
        mask = self._mask(group, q.device) if n > 1 or self.sliding_window else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal and mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(n * length, self.num_heads * self.head_dim)
        return out if n == 1 else out.index_select(0, group.padded_index)

    def _padded(self, x: torch.Tensor, group: AttentionGroup, heads: int) -> torch.Tensor:
        """``x`` ``[T_g, heads, D]`` scattered to ``[n, heads, max_len, D]`` (zero padding)."""
        out = x.new_zeros(group.num_seqs * group.max_len, heads, self.head_dim)
        out.index_copy_(0, group.padded_index, x)
        return out.view(group.num_seqs, group.max_len, heads, self.head_dim).transpose(1, 2)

    def _mask(self, group: AttentionGroup, device: torch.device) -> torch.Tensor | None:
        """The boolean mask (True: attend) or None when ``is_causal`` alone is right.

        A causal decoder needs no padding mask: a real query at position p sees keys
        0..p, all real; padded query rows see padding but are dropped afterwards."""
        window = self.sliding_window
        if self.causal and (window is None or window >= group.max_len):
            return None
        if not self.causal:
            return group.key_mask
        pos = torch.arange(group.max_len, device=device)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)  # query - key
        return ((diff >= 0) & (diff < window))[None, None]
