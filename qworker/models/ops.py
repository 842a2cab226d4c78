"""The small per-layer ops of the decoder models, each in one place.

Residual add + RMSNorm, RoPE, and the gated activation are the ops that dominate a
decode step's kernel count once attention and the matmuls are counted out
(docs/benchmarks.md). Models call them only through these functions, so the fused
kernels of ``cuda/fused_ops.cu`` (``qworker.models.fused_kernels``, on when enabled
for the tensors' device) replace all of them at once. The torch forms here are the
reference and the fallback: in fp32 they are bit-identical to transformers' (the
parity tests hold them to it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qworker.models.cpu_gemm import packed_of
from qworker.models.fused_kernels import active_for


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x @ weight.T + bias``: through the packed CPU kernel when ``weight`` was packed
    (``qworker.models.cpu_gemm.pack_model``) and ``x`` is fp32 on the CPU, else ``F.linear``."""
    packed = packed_of(weight)
    if packed is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        return packed.linear(x, bias)
    return F.linear(x, weight, bias)


def act_is_plain(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Both operands of a residual sum share shape and dtype (the fused kernel's case)."""
    return x.shape == residual.shape and x.dtype == residual.dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` computed in fp32 and cast back, as transformers' Llama."""
    fused = active_for(x, "rms_norm")
    if fused is not None:
        return fused.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One op instead of six; bit-identical to the form below in fp32.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(var + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the pre-norm block's residual step."""
    fused = active_for(x, "add_rms_norm")
    if fused is not None and act_is_plain(x, residual):
        return fused.add_rms_norm(x, residual, weight, eps)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def gated_act(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
    """``act(gate) * up`` of the fused ``[.., 2 * inter]`` gate/up projection."""
    fused = active_for(gate_up, "silu_and_mul")
    if fused is not None and act is F.silu and gate_up.dim() == 2:
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def rotate_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor],
              gathered: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` at ``positions``.

    ``tables`` are the model's cos/sin ``[max_pos, D / 2]`` in the activations' dtype;
    ``gathered`` is the step's cache: the torch form gathers cos/sin for the step's
    positions at the first layer and every later layer reuses them. The fused kernel
    reads the tables by position itself and rotates in place.
    """
    fused = active_for(q, "rotary")
    if (fused is not None and q.stride(2) == 1 and k.stride(2) == 1
            and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]
            and 2 * tables[0].shape[-1] == q.shape[2]):  # the kernel rotates whole heads
        return fused.rotary(q, k, positions, tables[0], tables[1])
    if not gathered:
        gathered.extend((tables[0][positions].unsqueeze(1), tables[1][positions].unsqueeze(1)))
    cos, sin = gathered
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` (NeoX halves) by per-token ``cos``/``sin``
    ``[T, 1, R / 2]`` (the step's positions, gathered once per step). With partial
    rotary (``R < D``, Phi-3/4) only the first ``R`` dimensions of each head rotate and
    the rest pass through, as transformers' Phi-3 does."""
    half = cos.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)
