"""FP8 layers split over tensor-parallel ranks: each rank's weight slice with its scales.

``qworker.models.quant.prepare`` makes these from the sharded layers of
``qworker.models.parallel_layers`` (docs/tensor_parallel.md, "FP8 weights"):

- ``Fp8ColumnParallelLinear`` / ``Fp8RowParallelLinear`` (GPU): this rank's rows (or
  columns) of the FP8 weight. Per-channel scales (per-tensor ones arrive expanded per
  channel) follow a column-parallel weight's rows and are replicated for a row-parallel
  one; block scales (``[N/bn, K/bk]``) are sliced on the weight's split dimension at
  block granularity (the rank boundaries are multiples of the block: ``check_blocks``);
  a static ``input_scale`` is replicated. Under online FP8 (``quantization="fp8"``) the
  dense checkpoint tensor arrives under both the weight's and its scale's names and each
  rank quantizes its own slice per channel (a row-parallel slice's row maxima are over
  its own columns, as vLLM quantizes each rank's shard).
- ``ActQuantColumnParallelLinear`` / ``ActQuantRowParallelLinear`` (CPU): dense slices
  (the weight stream dequantizes them lazily, slice by slice) whose input is
  FP8-quantized-dequantized as the scheme says. Dynamic per-token scales of a
  row-parallel layer come from the rank's input slice, as they do on the GPU.

A row-parallel layer all-reduces its partial sums and adds its bias once after (or,
``reduce=False``, leaves the sum to its block as ``RowParallelLinear`` does).
"""

from __future__ import annotations

import torch

from qworker.models.checkpoint_tensor import (
    CheckpointTensor,
    LazyTensor,
    Readable,
    read_all,
    read_cols,
    read_narrow,
    read_rows,
)
from qworker.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    RowRange,
    ShardInfo,
)
from qworker.models.quant.fp8 import FP8, dequantize_weight, quantize_weight_per_channel
from qworker.models.quant.fp8_linear import Fp8FusedLinear, _fake_quant, _InputScale
from qworker.models.quant.scheme import ActQuant, Fp8Scheme, WeightScales


class DequantizedSlices(LazyTensor):
    """An FP8 checkpoint weight ``w8`` ``[N, K]`` dequantized slice by slice with its
    canonical ``scales`` (``[N]`` per channel, or the block grid with ``block``), so a
    rank that runs it dense reads only its slice."""

    def __init__(self, w8: Readable, scales: torch.Tensor, dtype: torch.dtype,
                 block: tuple[int, int] | None) -> None:
        self.w8, self.scales, self.dtype, self.block = w8, scales, dtype, block
        self.shape = tuple(w8.shape)

    def narrow(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)``, dequantized."""
        n, k = self.shape
        w = read_narrow(self.w8, dim, start, stop).to(torch.float32)
        rows = torch.arange(start, stop) if dim == 0 else torch.arange(n)
        if self.block is None:
            s = self.scales[rows].unsqueeze(1)
        else:
            cols = torch.arange(start, stop) if dim == 1 else torch.arange(k)
            bn, bk = self.block
            s = self.scales[rows // bn][:, cols // bk]
        return (w * s).to(self.dtype)


class QuantizedSlices(LazyTensor):
    """A dense checkpoint weight quantized per channel and dequantized slice by slice
    (online FP8 emulated on the CPU): each rank's slice quantized on its own."""

    def __init__(self, dense: Readable, dtype: torch.dtype) -> None:
        self.dense, self.dtype = dense, dtype
        self.shape = tuple(dense.shape)

    def narrow(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows or columns ``[start, stop)``, quantized and dequantized per channel."""
        w8, scales = quantize_weight_per_channel(read_narrow(self.dense, dim, start, stop))
        return dequantize_weight(w8, scales, self.dtype)


def check_blocks(name: str, ranges: dict[str, RowRange], block: int, what: str,
                 world_size: int) -> None:
    """Raise ``TensorParallelConfigError`` (one line, naming the module) unless every
    rank boundary of ``ranges`` falls on a multiple of the FP8 weight ``block``."""
    from qworker.models.tp_plan import TensorParallelConfigError

    for part, rng in ranges.items():
        if rng.start % block or rng.size % block:
            label = f"{name} ({part})" if part else name
            raise TensorParallelConfigError(
                f"tensor_parallel_size={world_size} splits the {what} of {label} into "
                f"{rng.size}-wide slices, not a multiple of the FP8 weight block {block} "
                "(quantization_config weight_block_size / block_structure): use a "
                "tensor_parallel_size whose slices are whole blocks")


def _copy(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"{what}: checkpoint slice shape {tuple(source.shape)} != "
                         f"{tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(source)


def _is_fp8(tensor: Readable) -> bool:
    return getattr(tensor, "dtype", None) == FP8


def _dense_weight(tensor: Readable) -> bool:
    """An unread dense weight under its scale's name (online FP8: each rank computes its
    slice's scales); scales themselves arrive read, in their canonical form."""
    return isinstance(tensor, CheckpointTensor | LazyTensor) and len(tensor.shape) == 2 \
        and not _is_fp8(tensor)


class Fp8ColumnParallelLinear(Fp8FusedLinear):
    """A column-parallel linear (``ColumnParallelLinear``'s parts and ranges) with FP8
    weights; loads through ``load_checkpoint``."""

    def __init__(self, in_features: int, parts: dict[str, RowRange], bias: bool,
                 fused_checkpoint: bool, scheme: Fp8Scheme, dtype: torch.dtype) -> None:
        super().__init__(in_features, {n: r.size for n, r in parts.items()}, bias, scheme,
                         dtype)
        self.parts = dict(parts)
        self.fused_checkpoint = fused_checkpoint

    def load_checkpoint(self, part: str | None, kind: str, tensor: Readable) -> None:
        """Copy this rank's rows of checkpoint tensor ``tensor`` (``weight``,
        ``weight_scale``, ``bias``; ``input_scale`` whole) into part ``part`` (None: the
        whole projection, or every part of a fused checkpoint tensor)."""
        if kind == "input_scale":
            self._load_input_scale(part or "", read_all(tensor))
            return
        names = [part] if part is not None else list(self.parts)
        if part is None and len(names) > 1 and not self.fused_checkpoint:
            raise KeyError(f"{kind}: the checkpoint stores this projection's parts "
                           f"({', '.join(names)}) separately")
        base = 0
        for name in names:
            rng = self.parts[name]
            start, _ = self.offsets[name]
            lo, hi = base + rng.start, base + rng.stop
            what = f"{name or 'projection'}.{kind}"
            if kind == "bias":
                if self.bias is None:
                    raise KeyError(f"{what}: this projection has no bias")
                _copy(self.bias.data[start:start + rng.size], read_rows(tensor, lo, hi), what)
            elif kind == "weight" or (kind == "weight_scale" and _dense_weight(tensor)):
                rows = read_rows(tensor, lo, hi)
                if not _is_fp8(tensor):  # online FP8: quantize this rank's rows
                    w8, scales = quantize_weight_per_channel(rows)
                    rows = w8 if kind == "weight" else scales
                target = self.weight if kind == "weight" else self.weight_scale
                _copy(target.data[start:start + rng.size], rows, what)
            elif kind == "weight_scale" and self.scheme.weights is WeightScales.BLOCK:
                assert self.scheme.block is not None
                bn = self.scheme.block[0]
                _copy(self.weight_scale.data[start // bn:(start + rng.size) // bn],
                      read_rows(tensor, lo // bn, hi // bn), what)
            elif kind == "weight_scale":
                _copy(self.weight_scale.data[start:start + rng.size],
                      read_rows(tensor, lo, hi), what)
            else:
                raise KeyError(f"{what}: not a parameter of an FP8 layer")
            base += rng.total


class Fp8RowParallelLinear(Fp8FusedLinear):
    """A row-parallel linear (input columns ``cols``) with FP8 weights: partial sums
    all-reduced, the bias added once after."""

    def __init__(self, cols: RowRange, out_features: int, bias: bool, shard: ShardInfo,
                 reduce: bool, scheme: Fp8Scheme, dtype: torch.dtype) -> None:
        super().__init__(cols.size, {"": out_features}, bias, scheme, dtype)
        self.cols = cols
        self.shard = shard
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``sum over ranks (x_r @ dequant(W_r).T) + b`` (see ``RowParallelLinear``)."""
        if not self.reduce:
            return self.fp8_linear(x, self.bias if self.shard.rank == 0 else None)
        out = self.shard.all_reduce(self.fp8_linear(x, None))
        return out + self.bias if self.bias is not None else out

    def load_checkpoint(self, part: str | None, kind: str, tensor: Readable) -> None:
        """Copy this rank's columns of the weight (and of block scales); per-channel
        scales, the bias and a static input scale whole."""
        cols = self.cols
        if kind == "input_scale":
            self._load_input_scale(part or "", read_all(tensor))
        elif kind == "bias":
            if self.bias is None:
                raise KeyError("bias: this projection has no bias")
            _copy(self.bias.data, read_all(tensor), kind)
        elif kind == "weight" or (kind == "weight_scale" and _dense_weight(tensor)):
            sliced = read_cols(tensor, cols.start, cols.stop)
            if not _is_fp8(tensor):  # online FP8: quantize this rank's columns
                w8, scales = quantize_weight_per_channel(sliced)
                sliced = w8 if kind == "weight" else scales
            _copy((self.weight if kind == "weight" else self.weight_scale).data, sliced, kind)
        elif kind == "weight_scale" and self.scheme.weights is WeightScales.BLOCK:
            assert self.scheme.block is not None
            bk = self.scheme.block[1]
            _copy(self.weight_scale.data, read_cols(tensor, cols.start // bk, cols.stop // bk),
                  kind)
        elif kind == "weight_scale":
            _copy(self.weight_scale.data, read_all(tensor), kind)
        else:
            raise KeyError(f"{kind}: not a parameter of an FP8 layer")


class _ActQuant(_InputScale):
    """What both ``ActQuant*ParallelLinear`` add to their dense parallel layer (listed
    first in their bases, so ``super()`` reaches that layer): the input FP8-quantized-
    dequantized before the matmul, and a static ``input_scale`` to load."""

    act: ActQuant
    group_size: int | None

    def _init_act_quant(self, act: ActQuant, group_size: int | None) -> None:
        self.act = act
        self.group_size = group_size
        self.input_scale = (torch.nn.Parameter(torch.empty(1), requires_grad=False)
                            if act is ActQuant.STATIC_TENSOR else None)
        self._input_scale_seen = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The parallel layer's forward of ``fq(x)``."""
        return super().forward(_fake_quant(self, x))  # type: ignore[misc]

    def load_checkpoint(self, part: str | None, kind: str, tensor: Readable) -> None:
        """As the parallel layer's ``load_checkpoint``, plus a static ``input_scale``."""
        if kind == "input_scale":
            self._load_input_scale(part or "", read_all(tensor))
        else:
            super().load_checkpoint(part, kind, tensor)  # type: ignore[misc]


class ActQuantColumnParallelLinear(_ActQuant, ColumnParallelLinear):
    """A dense column-parallel slice whose input is FP8-quantized-dequantized (CPU):
    ``fq(x) @ W_r.T + b_r``."""

    def __init__(self, in_features: int, parts: dict[str, RowRange], bias: bool,
                 fused_checkpoint: bool, act: ActQuant, group_size: int | None) -> None:
        ColumnParallelLinear.__init__(self, in_features, parts, bias, fused_checkpoint)
        self._init_act_quant(act, group_size)


class ActQuantRowParallelLinear(_ActQuant, RowParallelLinear):
    """A dense row-parallel slice whose input slice is FP8-quantized-dequantized (CPU):
    ``sum over ranks (fq(x_r) @ W_r.T) + b``."""

    def __init__(self, cols: RowRange, out_features: int, bias: bool, shard: ShardInfo,
                 reduce: bool, act: ActQuant, group_size: int | None) -> None:
        RowParallelLinear.__init__(self, cols, out_features, bias, shard, reduce)
        self._init_act_quant(act, group_size)
