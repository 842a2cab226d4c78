"""The FP8 matmuls of a quantized linear layer, and the reference they are held to.

``Fp8Matmul`` picks one implementation per (device, scheme) and keeps it:

- ``ROWWISE``: W8A8 with per-token activation scales and per-channel weight scales
  through ``torch._scaled_mm`` (Hopper/Ada tensor cores, bf16 output). Per-tensor
  weight scales are stored per channel, so they take this path too.
- ``BLOCKWISE``: W8A8 with 1 x bk activation groups and bn x bk weight blocks through
  ``torch.nn.functional.scaled_mm``'s block-wise recipes, where the torch on the GPU has
  them; the scale layouts the kernel wants are found by a probe against the reference
  at first use (before any CUDA graph capture).
- ``DEQUANT``: W8A16 fallback, the FP8 weight dequantized (per channel or per block)
  into the activations' dtype inside the forward, then ``F.linear``. Weights stay FP8 in
  memory.

``reference_mm`` computes what the W8A8 kernels compute, in fp32 (CPU tests hold the
structure around the kernels to it; ``tests/models/quant`` holds the kernels to it on
a GPU).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qworker.models.quant.fp8 import dequantize_weight, expand_blocks

logger = logging.getLogger(__name__)


class MatmulKind(enum.Enum):
    """The implementation a quantized layer's matmul uses (see the module docstring)."""

    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    DEQUANT = "dequant"


def reference_mm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                 block: tuple[int, int] | None, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(x8, sx) @ dequant(w8, sw).T + bias`` in fp32, cast to ``out_dtype``.

    ``sx``: ``[M, 1]`` per token or ``[M, ceil(K/bk)]`` per group (with ``block``);
    ``sw``: ``[N]`` per channel or the block grid.
    """
    k = x8.shape[1]
    x = x8.to(torch.float32)
    if sx.shape[1] == 1:
        x = x * sx
    else:
        assert block is not None
        x = x * sx.repeat_interleave(block[1], dim=1)[:, :k]
    w = dequantize_weight(w8, sw, torch.float32, block)
    out = x @ w.t()
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def rowwise_mm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales: ``sx`` ``[M, 1]``, ``sw`` ``[N]``."""
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.view(1, -1), bias=bias,
                            out_dtype=out_dtype)


#: A block-wise matmul: (x8, sx [M, G], w8, sw grid, out_dtype) -> out.
BlockMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype],
                   torch.Tensor]


def _blockwise_variants() -> list[tuple[str, BlockMm]]:
    """Ways to call the block-wise kernel with the scale layouts different torch releases
    document; the probe keeps the first that matches the reference."""
    recipe = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or recipe is None:
        return []

    def call(x8: torch.Tensor, sa: torch.Tensor, w8: torch.Tensor, sb: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
        return F.scaled_mm(x8, w8.t(), sa, recipe.BlockWise1x128, sb, recipe.BlockWise128x128,
                           output_dtype=out_dtype)

    def outer_major(t: torch.Tensor) -> torch.Tensor:
        return t.t().contiguous().t()

    return [
        ("a outer-major, b as stored",
         lambda x8, sx, w8, sw, dt: call(x8, outer_major(sx), w8, sw, dt)),
        ("a outer-major, b transposed",
         lambda x8, sx, w8, sw, dt: call(x8, outer_major(sx), w8, sw.t(), dt)),
        ("a as made, b as stored", lambda x8, sx, w8, sw, dt: call(x8, sx, w8, sw, dt)),
    ]


_block_choice: dict[str, BlockMm | None] = {}


def blockwise_kernel(device: torch.device) -> BlockMm | None:
    """The block-wise W8A8 kernel for 128 x 128 weight blocks on ``device``, or None
    (probed once per device against ``reference_mm``)."""
    key = str(device)
    if key in _block_choice:
        return _block_choice[key]
    from qworker.models.quant.fp8 import quantize_act_per_group

    chosen: BlockMm | None = None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(32, 256, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(384, 256, generator=gen).to(device)
        sw = (w.abs().unflatten(0, (3, 128)).unflatten(2, (2, 128)).amax(dim=(1, 3)) / 448)
        w8 = (w / expand_blocks(sw, 384, 256, (128, 128))).to(torch.float8_e4m3fn)
        x8, sx = quantize_act_per_group(x, 128)
        want = reference_mm(x8, sx, w8, sw, (128, 128), None, torch.float32)
        for name, fn in _blockwise_variants():
            try:
                got = fn(x8, sx, w8, sw, torch.bfloat16).float()
            except (RuntimeError, TypeError, ValueError) as exc:
                logger.debug("block-wise scaled_mm (%s) refused: %s", name, exc)
                continue
            if torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max())):
                chosen = fn
                logger.info("FP8 block-scaled matmul: torch scaled_mm (%s)", name)
                break
    if chosen is None:
        logger.info("FP8 block-scaled matmul on %s: dequantize per block (W8A16)", device)
    _block_choice[key] = chosen
    return chosen


_rowwise_ok: dict[str, bool] = {}


def rowwise_available(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` row-wise W8A8 (with a bias) serves ``out_dtype`` on
    ``device``: sm89+, a bf16 output, and a probe against ``reference_mm`` (once)."""
    if not (device.type == "cuda" and out_dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9)):
        return False
    key = str(device)
    if key not in _rowwise_ok:
        from qworker.models.quant.fp8 import quantize_act_per_token, quantize_weight_per_channel

        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(24, 256, generator=gen).to(device, torch.bfloat16)
        w8, sw = quantize_weight_per_channel(torch.randn(128, 256, generator=gen).to(device))
        bias = torch.randn(128, generator=gen).to(device, torch.bfloat16)
        x8, sx = quantize_act_per_token(x)
        want = reference_mm(x8, sx, w8, sw, None, bias, torch.float32)
        try:
            got = rowwise_mm(x8, sx, w8, sw, bias, torch.bfloat16).float()
            ok = bool(torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max())))
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.info("torch._scaled_mm row-wise unavailable: %s", exc)
            ok = False
        logger.info("FP8 row-wise matmul on %s: %s", device,
                    "torch._scaled_mm" if ok else "dequantize (W8A16)")
        _rowwise_ok[key] = ok
    return _rowwise_ok[key]


def dequant_mm(x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A16: the weight dequantized into ``x``'s dtype for this call, then ``F.linear``.
    A per-channel scale commutes with the matmul, so it scales the output instead."""
    if block is None:
        out = F.linear(x, w8.to(x.dtype)) * sw.to(x.dtype)
        return out if bias is None else out + bias
    return F.linear(x, dequantize_weight(w8, sw, x.dtype, block), bias)


#: A row-wise scaled grouped matmul: (x8 [S, K], sx [S, 1], w8 [E, N, K], sw [E, N],
#: offs [E] int32, out_dtype) -> [S, N].
GroupedMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                      torch.dtype], torch.Tensor]


def reference_grouped_mm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor,
                         sw: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
                         ) -> torch.Tensor:
    """What the row-wise scaled grouped kernel computes, in fp32 (reads ``offs`` on the
    host: tests only)."""
    x = x8.to(torch.float32) * sx
    out = torch.zeros(x8.shape[0], w8.shape[1], dtype=torch.float32, device=x8.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w = w8[e].to(torch.float32) * sw[e].unsqueeze(1)
            out[start:end] = x[start:end] @ w.t()
        start = end
    return out.to(out_dtype)


def _grouped_variants() -> list[tuple[str, GroupedMm]]:
    variants: list[tuple[str, GroupedMm]] = []
    if hasattr(torch, "_scaled_grouped_mm"):
        variants.append(("torch._scaled_grouped_mm", lambda x8, sx, w8, sw, offs, dt:
                         torch._scaled_grouped_mm(x8, w8.transpose(1, 2), sx.reshape(-1),
                                                  sw, offs=offs, out_dtype=dt)))
    recipe = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_grouped_mm") and recipe is not None:
        variants.append(("F.scaled_grouped_mm row-wise", lambda x8, sx, w8, sw, offs, dt:
                         F.scaled_grouped_mm(x8, w8.transpose(1, 2), sx.reshape(-1),
                                             recipe.RowWise, sw, recipe.RowWise, offs=offs,
                                             output_dtype=dt)))
    return variants


_grouped_choice: dict[str, GroupedMm | None] = {}


def grouped_kernel(device: torch.device) -> GroupedMm | None:
    """The row-wise W8A8 grouped kernel for FP8 MoE experts on ``device``, or None
    (probed once per device against ``reference_grouped_mm``)."""
    key = str(device)
    if key in _grouped_choice:
        return _grouped_choice[key]
    from qworker.models.quant.fp8 import quantize_act_per_token

    chosen: GroupedMm | None = None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(40, 256, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(4, 128, 256, generator=gen).to(device)
        sw = w.abs().amax(dim=2) / 448
        w8 = (w / sw.unsqueeze(2)).to(torch.float8_e4m3fn)
        x8, sx = quantize_act_per_token(x)
        offs = torch.tensor([16, 16, 32, 40], dtype=torch.int32, device=device)
        want = reference_grouped_mm(x8, sx, w8, sw, offs, torch.float32)
        for name, fn in _grouped_variants():
            try:
                got = fn(x8, sx, w8, sw, offs, torch.bfloat16).float()
            except (RuntimeError, TypeError, ValueError) as exc:
                logger.debug("scaled grouped mm (%s) refused: %s", name, exc)
                continue
            if torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max())):
                chosen = fn
                logger.info("FP8 MoE experts: %s", name)
                break
    if chosen is None:
        logger.info("FP8 MoE experts on %s: no scaled grouped kernel; experts stay in the "
                    "model dtype", device)
    _grouped_choice[key] = chosen
    return chosen
