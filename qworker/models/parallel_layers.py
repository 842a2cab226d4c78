"""Tensor-parallel layers: each rank holds one slice of a layer and computes its part.

Megatron-LM's split (Shoeybi et al., 2019), as vLLM serves it:

- ``ColumnParallelLinear``: output features split. A fused projection (q/k/v, gate/up)
  keeps its parts in order and each part is split on its own, so rank ``r`` holds
  ``[q_r, k_r, v_r]`` or ``[gate_r, up_r]`` and the model's ``split``/``chunk`` of the
  output works unchanged. Query heads split evenly; KV heads split when there are at
  least as many as ranks, else each rank holds the one KV head its query heads read
  (replicated over ``world_size / num_kv_heads`` ranks). No communication.
- ``RowParallelLinear``: input features split (they come from a column-parallel layer's
  shard), one all-reduce of the partial sums, the bias added once after it.
- ``VocabParallelEmbedding``: the vocabulary's rows split (padded to ``ceil(V / N)``
  rows a rank); ids outside a rank's range look up zeros; one all-reduce.
- The LM head is a column-parallel linear over the same vocabulary rows: each rank's
  logits cover its rows and the model runner gathers them on rank 0 only
  (``qworker.engine.parallel``).

Every layer knows the checkpoint rows or columns it owns (``RowRange``) and reads only
those through ``load_checkpoint`` (``qworker.models.checkpoint_tensor``). An
embedding lookup is exact (one rank adds its row, the others zeros); a matmul over a
slice may round differently from the whole one, as any change of GEMM shape may, and
row-parallel partial sums do (docs/operations.md, "Tensor parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qworker.models.checkpoint_tensor import Readable, read_all, read_cols, read_rows
from qworker.models.ops import linear


class Reducer(Protocol):
    """Sums a tensor over the ranks (``qworker.engine.parallel.group.RankGroup``)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place across every rank; returns it."""


@dataclass(slots=True)
class ShardInfo:
    """Which slice of the model this process holds: ``rank`` of ``world_size``.

    ``reducer`` is None for one rank, and in tests that sum the ranks' partials by hand.
    """

    rank: int
    world_size: int
    reducer: Reducer | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks (unchanged without a reducer)."""
        if self.reducer is None or self.world_size == 1:
            return tensor
        return self.reducer.all_reduce(tensor)


@dataclass(frozen=True, slots=True)
class RowRange:
    """Rows ``[start, stop)`` of a checkpoint dimension of ``total`` rows, held by one rank
    in ``size >= stop - start`` rows (the rest zero padding: the vocabulary's last rank)."""

    start: int
    stop: int
    size: int
    total: int

    @property
    def count(self) -> int:
        """Rows read from the checkpoint."""
        return self.stop - self.start


def even_range(total: int, rank: int, world_size: int) -> RowRange:
    """Rank ``rank``'s equal share of ``total`` rows (``total`` divisible by the ranks)."""
    if total % world_size:
        raise ValueError(f"{total} rows do not split over {world_size} ranks")
    size = total // world_size
    return RowRange(rank * size, (rank + 1) * size, size, total)


def padded_range(total: int, rank: int, world_size: int) -> RowRange:
    """Rank ``rank``'s ``ceil(total / world_size)`` rows, the last rank's padded."""
    size = -(-total // world_size)
    start = min(total, rank * size)
    return RowRange(start, min(total, start + size), size, total)


def kv_head_range(num_kv_heads: int, head_dim: int, rank: int, world_size: int) -> RowRange:
    """The K (or V) projection rows of rank ``rank``: its share of the KV heads, or the
    one head its query heads read when there are fewer KV heads than ranks."""
    if num_kv_heads >= world_size:
        heads = even_range(num_kv_heads, rank, world_size)
        return RowRange(heads.start * head_dim, heads.stop * head_dim, heads.size * head_dim,
                        num_kv_heads * head_dim)
    head = rank * num_kv_heads // world_size
    return RowRange(head * head_dim, (head + 1) * head_dim, head_dim, num_kv_heads * head_dim)


def _copy_rows(target: torch.Tensor, rows: torch.Tensor, rng: RowRange, what: str) -> None:
    expected = (rng.count, *target.shape[1:])
    if tuple(rows.shape) != expected:
        raise ValueError(f"{what}: checkpoint slice shape {tuple(rows.shape)} != {expected}")
    target[: rng.count].copy_(rows)
    target[rng.count :].zero_()


def _check_total(tensor: Readable, dim: int, total: int, what: str) -> None:
    shape = tuple(tensor.shape)
    if len(shape) <= dim or shape[dim] != total:
        raise ValueError(f"{what}: checkpoint shape {shape} has not {total} rows in dim {dim}")


class ColumnParallelLinear(nn.Module):
    """A linear (or fused linear) layer whose output features are split over the ranks.

    ``parts`` names the projection's parts in order (``{"q": .., "k": .., "v": ..}``, or
    ``{"": range}`` for a plain linear) with the checkpoint rows this rank holds. Like
    ``qworker.models.layers.FusedLinear`` it offers ``shards`` (local widths) and
    ``split_sizes``. ``fused_checkpoint``: the checkpoint stores every part in one tensor
    (Phi-3's ``qkv_proj``), part after part, instead of one tensor each.
    """

    def __init__(self, in_features: int, parts: dict[str, RowRange], bias: bool,
                 fused_checkpoint: bool = False) -> None:
        super().__init__()
        self.parts = dict(parts)
        self.shards = {name: rng.size for name, rng in parts.items()}
        self.fused_checkpoint = fused_checkpoint
        self.offsets: dict[str, int] = {}
        start = 0
        for name, rng in parts.items():
            self.offsets[name] = start
            start += rng.size
        self.in_features = in_features
        self.out_features = start
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.empty(start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features ``x @ W_r.T + b_r`` (parts in order)."""
        return linear(x, self.weight, self.bias)

    @property
    def split_sizes(self) -> list[int]:
        """Local output widths of the parts, in order."""
        return list(self.shards.values())

    def load_checkpoint(self, part: str | None, kind: str, tensor: Readable) -> None:
        """Copy this rank's rows of checkpoint tensor ``tensor`` (``kind`` ``"weight"`` or
        ``"bias"``) into part ``part`` (None: the whole projection, or every part of a
        fused checkpoint tensor). Reads only those rows."""
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise KeyError(f"{part or 'projection'}.{kind}: this projection has no bias")
        names = [part] if part is not None else list(self.parts)
        if part is None and len(names) > 1 and not self.fused_checkpoint:
            raise KeyError(f"{kind}: the checkpoint stores this projection's parts "
                           f"({', '.join(names)}) separately")
        base = 0
        if part is None:
            _check_total(tensor, 0, sum(self.parts[n].total for n in names), kind)
        else:
            _check_total(tensor, 0, self.parts[part].total, f"{part}.{kind}")
        for name in names:
            rng = self.parts[name]
            start = self.offsets[name]
            rows = read_rows(tensor, base + rng.start, base + rng.stop)
            with torch.no_grad():
                _copy_rows(param.data[start : start + rng.size], rows, rng,
                           f"{name or 'projection'}.{kind}")
            base += rng.total


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the ranks (``cols``), summed by
    one all-reduce; the bias (replicated) is added once, after the sum.

    ``reduce=False``: the forward returns this rank's partial sum (the bias on rank 0
    only) and the enclosing block sums it with its own partials in one all-reduce
    (Qwen2-MoE's shared expert beside the experts, ``qworker.models.moe``)."""

    def __init__(self, cols: RowRange, out_features: int, bias: bool, shard: ShardInfo,
                 reduce: bool = True) -> None:
        super().__init__()
        self.cols = cols
        self.shard = shard
        self.reduce = reduce
        self.in_features = cols.size
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, cols.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``sum over ranks (x_r @ W_r.T) + b`` (every rank gets the sum); without
        ``reduce`` this rank's term of that sum."""
        if not self.reduce:
            return linear(x, self.weight, self.bias if self.shard.rank == 0 else None)
        out = self.shard.all_reduce(linear(x, self.weight))
        if self.bias is not None:
            out = out + self.bias
        return out

    def load_checkpoint(self, part: str | None, kind: str, tensor: Readable) -> None:
        """Copy this rank's input columns of the checkpoint weight (the bias whole)."""
        if kind == "bias":
            if self.bias is None:
                raise KeyError("bias: this projection has no bias")
            with torch.no_grad():
                self.bias.data.copy_(read_all(tensor))
            return
        _check_total(tensor, 1, self.cols.total, "weight")
        cols = read_cols(tensor, self.cols.start, self.cols.stop)
        if tuple(cols.shape) != tuple(self.weight.shape):
            raise ValueError(f"weight: checkpoint slice shape {tuple(cols.shape)} != "
                             f"{tuple(self.weight.shape)}")
        with torch.no_grad():
            self.weight.data.copy_(cols)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding table whose rows (token ids ``rows.start .. rows.stop``) are split over
    the ranks; the lookups of every rank are summed by one all-reduce."""

    def __init__(self, rows: RowRange, embedding_dim: int, shard: ShardInfo) -> None:
        super().__init__(rows.size, embedding_dim)
        self.rows = rows
        self.shard = shard

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input`` ids: this rank's rows, zeros elsewhere, summed."""
        if self.shard.world_size == 1:
            return F.embedding(input, self.weight)
        outside = (input < self.rows.start) | (input >= self.rows.stop)
        local = (input - self.rows.start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.shard.all_reduce(out)

    def load_checkpoint(self, part: str | None, kind: str, tensor: Readable) -> None:
        """Copy this rank's rows of the checkpoint table (the padding rows zeroed)."""
        _check_total(tensor, 0, self.rows.total, kind)
        with torch.no_grad():
            _copy_rows(self.weight.data, read_rows(tensor, self.rows.start, self.rows.stop),
                       self.rows, kind)

