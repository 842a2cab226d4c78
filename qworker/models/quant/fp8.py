"""FP8 (E4M3) weight and activation arithmetic: scales, (de)quantization, fake quantization.

Conventions (docs/quantization.md): a scale is the dequantization multiplier, ``x ~= x8 * s``
(compressed-tensors' ``weight_scale`` and fine-grained FP8's ``weight_scale_inv`` both
mean that). Quantizing divides by the scale, clamps to +-448 and rounds to nearest
(torch's cast). Block scales tile a ``[N, K]`` weight in ``(bn, bk)`` blocks, the last
row and column of blocks possibly partial, so the grid is ``[ceil(N/bn), ceil(K/bk)]``.
Activation fake quantization is compressed-tensors' formula exactly (a per-token scale
``amax(|x|) / 448``, the dtype's eps where that is 0), so a CPU model that emulates it
matches transformers' compressed-tensors reference bit for bit in fp32.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def expand_blocks(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]
                  ) -> torch.Tensor:
    """A ``[ceil(rows/bn), ceil(cols/bk)]`` block-scale grid as one scale per element
    ``[rows, cols]`` (partial edge blocks cut off)."""
    bn, bk = block
    return scales.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize_weight(w8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                      block: tuple[int, int] | None = None) -> torch.Tensor:
    """``w8 * scales`` in fp32, cast to ``dtype``. ``scales``: one value (per tensor),
    ``[N]`` or ``[N, 1]`` (per channel) or a block grid (with ``block``)."""
    w = w8.to(torch.float32)
    s = scales.to(device=w.device, dtype=torch.float32)
    if block is not None:
        s = expand_blocks(s, w.shape[0], w.shape[1], block)
    elif s.numel() == 1:
        s = s.reshape(())
    else:
        s = s.reshape(-1, 1)
    return (w * s).to(dtype)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w8 [N, K], scales [N] fp32)`` with one scale per output row, ``amax / 448``."""
    w32 = w.to(torch.float32)
    scales = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    w8 = (w32 / scales.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8, scales


def _token_scales(x: torch.Tensor) -> torch.Tensor:
    scales = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    return torch.where(scales == 0, torch.finfo(x.dtype).eps, scales)


def quantize_act_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8 [M, K], scales [M, 1] fp32)``: dynamic per-token activation quantization."""
    x32 = x.to(torch.float32)
    scales = _token_scales(x32)
    return (x32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def quantize_act_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8 [M, K], scales [M, ceil(K/group)] fp32)``: dynamic scales per token and
    ``group`` input columns (the last group possibly partial)."""
    x32 = x.to(torch.float32)
    m, k = x32.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x32, (0, groups * group - k)).view(m, groups, group)
    scales = _token_scales(padded)  # [M, G, 1]
    x8 = (padded / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, groups * group)[:, :k]
    return x8, scales.squeeze(-1)


def quantize_act_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` quantized with a calibrated per-tensor ``scale`` (one value)."""
    return (x.to(torch.float32) / scale.to(torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(x))`` per token, in ``x``'s dtype (compressed-tensors' QDQ)."""
    scales = _token_scales(x)
    return (x / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scales


def fake_quant_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per-token, per-``group``-columns QDQ in ``x``'s dtype (compressed-tensors' group
    strategy: the last group possibly partial)."""
    k = x.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x, (0, groups * group - k))
    grouped = padded.unflatten(-1, (groups, group))
    scales = _token_scales(grouped)
    out = (grouped / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scales
    return out.flatten(-2)[..., :k]


def fake_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """QDQ of ``x`` with a calibrated per-tensor ``scale``, in ``x``'s dtype."""
    s = scale.to(x.dtype).reshape(())
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * s
