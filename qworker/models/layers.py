"""Building blocks shared by the model families: norms, fused projections, activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qworker.models.ops import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as transformers' Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension and scale by ``weight``."""
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one fused step."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class FusedLinear(nn.Module):
    """Several linear maps of the same input stacked into one matmul.

    ``shards`` names the parts in order with their output sizes; ``load_shard`` copies
    one checkpoint tensor (weight or bias) into its rows.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shards = dict(shards)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size
        self.out_features = start
        self.weight = nn.Parameter(torch.empty(start, in_features))
        self.bias = nn.Parameter(torch.empty(start)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for all shards at once; split the result with ``split_sizes``."""
        return F.linear(x, self.weight, self.bias)

    @property
    def split_sizes(self) -> list[int]:
        """Output widths of the shards, in order."""
        return list(self.shards.values())

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the rows of ``shard``; ``kind`` is ``"weight"`` or ``"bias"``."""
        start, size = self.offsets[shard]
        param = self.weight if kind == "weight" else self.bias
        if param is None:
            raise KeyError(f"{shard}.{kind}: this projection has no bias")
        target = param.data[start : start + size]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{shard}.{kind}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
            )
        target.copy_(tensor)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called ``name`` in HF configs (silu, relu, gelu, ...)."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "relu":
        return F.relu
    from transformers.activations import ACT2FN

    try:
        return ACT2FN[name]
    except KeyError as exc:
        from qworker.errors import ModelLoadError

        raise ModelLoadError(f"unsupported activation function {name!r}") from exc
