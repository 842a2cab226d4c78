"""MoE experts under FP8: FP8 weights and a W8A8 grouped GEMM on the GPU, emulation on the CPU.

``Fp8FusedExperts`` keeps ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` in
FP8 with fp32 per-channel scales (``gate_up_scale`` ``[E, 2I]``, ``down_scale`` ``[E, H]``)
and runs both projections through the row-wise scaled grouped kernel torch offers
(``fp8_mm.grouped_kernel``, probed once; the model keeps bf16 experts where it is
missing), activations quantized per row (dynamic per token). Tokens are sorted by expert
and the offsets computed on the device exactly as for bf16 experts
(``qworker.models.moe_exec``), so nothing syncs with the host.

Expert tensors arrive dense (FP8 checkpoint experts are dequantized by the weight stream)
and are quantized per channel as they load; a per-channel FP8 checkpoint's experts come
back bit for bit (their row maxima are 448 x scale), others within FP8's rounding.

``ActQuantFusedExperts`` is the CPU's form under ``quantization="fp8"``: weights
quantized-dequantized per channel on load, each matmul's input rows
quantized-dequantized per token: what the GPU computes, in dense arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qworker.models.moe import FusedExperts
from qworker.models.moe_exec import combine, expert_offsets, run_experts, sort_pairs
from qworker.models.quant.fp8 import (
    FP8,
    dequantize_weight,
    fake_quant_per_token,
    quantize_act_per_token,
    quantize_weight_per_channel,
)
from qworker.models.quant.fp8_mm import grouped_kernel, reference_grouped_mm


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Fp8FusedExperts(FusedExperts):
    """Experts in FP8 (see the module docstring). Build on the meta device."""

    def __init__(self, num_experts: int, hidden: int, inter: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(num_experts, hidden, inter, act)
        self.gate_up_proj = _empty(num_experts, 2 * inter, hidden, dtype=FP8)
        self.down_proj = _empty(num_experts, hidden, inter, dtype=FP8)
        self.gate_up_scale = _empty(num_experts, 2 * inter, dtype=torch.float32)
        self.down_scale = _empty(num_experts, hidden, dtype=torch.float32)
        self.use_reference = False

    def load(self, part: str, tensor: torch.Tensor, expert: int | None = None) -> str:
        """Quantize a dense checkpoint tensor per channel into place (see ``FusedExperts``)."""
        if expert is None:
            param = getattr(self, part)
            self._check(part, tuple(tensor.shape), tuple(param.shape))
            w8, scales = quantize_weight_per_channel(tensor.reshape(-1, tensor.shape[-1]))
            param.data.copy_(w8.view(param.shape))
            scale = self.gate_up_scale if part == "gate_up_proj" else self.down_scale
            scale.data.copy_(scales.view(scale.shape))
            self._seen[part] = {(e, p) for e in range(self.num_experts)
                                for p in ("gate", "up", "down")}
            return part
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts")
        if part == "down":
            name, rows = "down_proj", slice(0, self.hidden)
            scale = self.down_scale
        else:
            name = "gate_up_proj"
            start = 0 if part == "gate" else self.inter
            rows, scale = slice(start, start + self.inter), self.gate_up_scale
        target = getattr(self, name).data[expert, rows]
        self._check(f"expert {expert} {part}", tuple(tensor.shape), tuple(target.shape))
        w8, scales = quantize_weight_per_channel(tensor)
        target.copy_(w8)
        scale.data[expert, rows].copy_(scales)
        self._seen[name].add((expert, part))
        return name

    def complete(self) -> list[str]:
        """The weights fully loaded, with their scales."""
        done = super().complete()
        scales = {"gate_up_proj": "gate_up_scale", "down_proj": "down_scale"}
        return done + [scales[name] for name in done]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for every token, W8A8 per projection."""
        flat, order, xs = sort_pairs(x, ids)
        offs = expert_offsets(flat, self.num_experts)
        mm = reference_grouped_mm if self.use_reference else grouped_kernel(x.device)
        assert mm is not None, "Fp8FusedExperts needs the scaled grouped kernel"
        x8, sx = quantize_act_per_token(xs)
        h = mm(x8, sx, self.gate_up_proj, self.gate_up_scale, offs, x.dtype)
        gate, up = h.split(self.inter, dim=-1)
        a8, sa = quantize_act_per_token(self.act(gate) * up)
        ys = mm(a8, sa, self.down_proj, self.down_scale, offs, x.dtype)
        return combine(ys, weights, order, x.shape[0], x.dtype)


class ActQuantFusedExperts(FusedExperts):
    """Dense experts that compute what ``Fp8FusedExperts`` does (CPU, ``quantization="fp8"``)."""

    def load(self, part: str, tensor: torch.Tensor, expert: int | None = None) -> str:
        """Quantize-dequantize the tensor per channel, then load it densely."""
        flat = tensor.reshape(-1, tensor.shape[-1])
        w8, scales = quantize_weight_per_channel(flat)
        qdq = dequantize_weight(w8, scales, tensor.dtype).view(tensor.shape)
        return super().load(part, qdq, expert)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum with per-token FP8 QDQ of each matmul's input."""
        return run_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.act,
                           act_quant=fake_quant_per_token)
