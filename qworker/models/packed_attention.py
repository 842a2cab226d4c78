"""Prefill-only attention over packed variable-length inputs (the embedding models).

An embedding step runs several inputs of different lengths at once with no KV cache.
Their tokens are packed end to end (``PackedBatch``: ``cu_seqlens`` and per-token
segment ids and positions), so every matmul and norm runs over real tokens only, with
no padding. Only attention needs each input apart: ``PackedAttention`` scatters q/k/v
into a padded ``[inputs, heads, max_len, head_dim]`` view with one ``index_copy`` each,
runs torch SDPA once for the whole step (a key-padding mask for encoders, ``is_causal``
for decoders, FlashAttention/efficient kernels on a GPU), and gathers the real rows
back. Padding thus costs only in attention, where it is a small share (docs/embeddings.md,
"Packing", has the measurement that chose this over padding everything and over one
block-diagonal mask over all tokens).

Models whose attention modules are called without the step (the decoder stack built
for paged attention) find it through ``packed_context``, a thread-local like
``qworker.attention.paged_attention.forward_context``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class PackedBatch:
    """The layout of one step's packed inputs (every tensor on the model's device).

    ``cu_seqlens`` int64 ``[n + 1]`` (input ``i`` is tokens ``cu[i]:cu[i+1]``),
    ``lengths`` ``[n]``, ``seq_ids`` and ``positions`` ``[T]`` (the input of each token
    and its position in it), ``padded_index`` ``[T]`` (its row in the padded
    ``[n * max_len]`` layout) and ``key_mask`` bool ``[n, 1, 1, max_len]`` (True: a real
    key).
    """

    cu_seqlens: torch.Tensor
    lengths: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    padded_index: torch.Tensor
    key_mask: torch.Tensor
    max_len: int
    num_tokens: int

    @property
    def num_seqs(self) -> int:
        """How many inputs the step packs."""
        return int(self.lengths.shape[0])

    @classmethod
    def build(cls, lengths: list[int], device: torch.device) -> PackedBatch:
        """The layout of inputs of ``lengths`` tokens (each >= 1), built with tensor ops."""
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        total, max_len = int(cu[-1]), int(lens.max())
        seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        positions = torch.arange(total) - cu[:-1].index_select(0, seq_ids)
        padded = seq_ids * max_len + positions
        key_mask = (torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
        return cls(cu.to(device), lens.to(device), seq_ids.to(device), positions.to(device),
                   padded.to(device), key_mask.to(device), max_len, total)


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
        n, length = batch.num_seqs, batch.max_len
        shapes = ((self.num_heads, query), (self.num_kv_heads, key), (self.num_kv_heads, value))
        if n == 1:  # one input: no padding at all
            q, k, v = (t.reshape(1, -1, h, self.head_dim).transpose(1, 2) for h, t in shapes)
        else:
            q, k, v = (self._padded(t.reshape(-1, h, self.head_dim), batch, h)
                       for h, t in shapes)
        mask = self._mask(batch, q.device) if n > 1 or self.sliding_window else None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal and mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(n * length, self.num_heads * self.head_dim)
        return out if n == 1 else out.index_select(0, batch.padded_index)

    def _padded(self, x: torch.Tensor, batch: PackedBatch, heads: int) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` scattered to ``[n, heads, max_len, D]`` (zero padding)."""
        out = x.new_zeros(batch.num_seqs * batch.max_len, heads, self.head_dim)
        out.index_copy_(0, batch.padded_index, x)
        return out.view(batch.num_seqs, batch.max_len, heads, self.head_dim).transpose(1, 2)

    def _mask(self, batch: PackedBatch, device: torch.device) -> torch.Tensor | None:
        """The boolean mask (True: attend) or None when ``is_causal`` alone is right.

        A causal decoder needs no padding mask: a real query at position p sees keys
        0..p, all real; padded query rows see padding but are dropped afterwards."""
        window = self.sliding_window
        if self.causal and (window is None or window >= batch.max_len):
            return None
        if not self.causal:
            return batch.key_mask
        pos = torch.arange(batch.max_len, device=device)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)  # query - key
        return ((diff >= 0) & (diff < window))[None, None]
