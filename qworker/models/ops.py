"""The small per-layer ops of the decoder models, each in one place.

Residual add + RMSNorm, RoPE from per-step cos/sin, and the gated activation are the
ops that dominate a decode step's kernel count once attention and the matmuls are
counted out (docs/benchmarks.md). Models call them only through these functions, so
a fused implementation replaces all of them at once. The torch forms here are the
reference: in fp32 they are bit-identical to transformers' (the parity tests hold
them to it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` computed in fp32 and cast back, as transformers' Llama."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One op instead of six; bit-identical to the form below in fp32.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the pre-norm block's residual step."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def gated_act(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """``act(gate) * up`` of the fused ``[.., 2 * inter]`` gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` (NeoX halves) by per-token ``cos``/``sin``
    ``[T, 1, D / 2]`` (the step's positions, gathered once per step)."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
