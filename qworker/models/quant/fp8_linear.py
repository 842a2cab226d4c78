"""Linear layers of FP8 models: FP8 weights on the GPU, activation emulation on the CPU.

``Fp8FusedLinear`` / ``Fp8Linear`` hold the weight in FP8 (``weight`` ``[N, K]``
float8_e4m3fn) with fp32 ``weight_scale`` (``[N]`` per channel; per-tensor checkpoint
scales are stored per channel, which also lets fused q/k/v shards keep their own; or a
block grid), an optional static ``input_scale`` and the bias in the model dtype. Their
forward quantizes the activations as the scheme says and calls one ``fp8_mm`` kernel.

``ActQuantFusedLinear`` / ``ActQuantLinear`` are the CPU's form: dense weights
(dequantized on load) and the scheme's activation quantization emulated
(quantize-dequantize), which is what compressed-tensors' own forward does, so a CPU
model matches transformers' reference on such checkpoints.

Fused shards with static input scales share one: the largest (vLLM's choice; calibrated
on the same input they are equal).
"""

from __future__ import annotations

import torch
from torch import nn

from qworker.models.layers import FusedLinear
from qworker.models.ops import linear
from qworker.models.quant.fp8 import (
    FP8,
    fake_quant_per_group,
    fake_quant_per_token,
    fake_quant_static,
    quantize_act_per_group,
    quantize_act_per_token,
    quantize_act_static,
)
from qworker.models.quant.fp8_mm import (
    MatmulKind,
    blockwise_kernel,
    dequant_mm,
    reference_mm,
    rowwise_available,
    rowwise_mm,
)
from qworker.models.quant.scheme import ActQuant, Fp8Scheme, WeightScales


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _InputScale:
    """A static input scale shared by a module's shards: the largest loaded wins."""

    input_scale: nn.Parameter | None
    _input_scale_seen: set[str]

    def _load_input_scale(self, shard: str, tensor: torch.Tensor) -> None:
        if self.input_scale is None:
            raise KeyError(f"{shard}.input_scale: this layer's scheme has no static scale")
        value = tensor.to(torch.float32).reshape(1).to(self.input_scale.device)
        if self._input_scale_seen:
            value = torch.maximum(value, self.input_scale.data)
        self.input_scale.data.copy_(value)
        self._input_scale_seen.add(shard)


class Fp8FusedLinear(FusedLinear, _InputScale):
    """Stacked linear maps with FP8 weights (see the module docstring). Build on the meta
    device; parameters are filled by ``load_shard`` (or by name for a single shard)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool,
                 scheme: Fp8Scheme, dtype: torch.dtype) -> None:
        super().__init__(in_features, shards, bias)
        self.scheme = scheme
        n = self.out_features
        self.weight = _empty(n, in_features, dtype=FP8)
        if scheme.weights is WeightScales.BLOCK:
            assert scheme.block is not None
            bn, bk = scheme.block
            self.weight_scale = _empty(-(-n // bn), -(-in_features // bk), dtype=torch.float32)
        else:
            self.weight_scale = _empty(n, dtype=torch.float32)
        if bias:
            self.bias = _empty(n, dtype=dtype)
        static = scheme.activations is ActQuant.STATIC_TENSOR
        self.input_scale = _empty(1, dtype=torch.float32) if static else None
        self._input_scale_seen = set()
        self.kind: MatmulKind | None = None
        self.use_reference = False

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        """Copy a shard's ``weight`` (FP8), ``weight_scale`` (its rows: per channel, or its
        block rows), ``input_scale`` or ``bias`` into place."""
        if kind == "input_scale":
            self._load_input_scale(shard, tensor)
            return
        if kind != "weight_scale":
            super().load_shard(shard, kind, tensor)
            return
        start, size = self.offsets[shard]
        if self.scheme.weights is WeightScales.BLOCK:
            assert self.scheme.block is not None
            bn = self.scheme.block[0]
            if start % bn:
                raise ValueError(f"{shard} starts at row {start}, inside a {bn}-row block")
            target = self.weight_scale.data[start // bn : start // bn + -(-size // bn)]
        else:
            target = self.weight_scale.data[start : start + size]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{shard}.weight_scale: checkpoint shape {tuple(tensor.shape)} "
                             f"!= {tuple(target.shape)}")
        target.copy_(tensor)

    def matmul_kind(self, x: torch.Tensor) -> MatmulKind:
        """The kernel this layer uses for ``x``'s device and dtype (chosen once)."""
        if self.kind is None:
            acts, weights = self.scheme.activations, self.scheme.weights
            if acts is ActQuant.NONE:
                self.kind = MatmulKind.DEQUANT
            elif weights is WeightScales.BLOCK:
                ok = (self.scheme.block == (128, 128) and self.scheme.group_size == 128
                      and x.dtype == torch.bfloat16 and self.in_features_ok(128)
                      and blockwise_kernel(x.device) is not None)
                self.kind = MatmulKind.BLOCKWISE if ok else MatmulKind.DEQUANT
            elif acts is ActQuant.DYNAMIC_GROUP:
                self.kind = MatmulKind.DEQUANT
            else:
                ok = rowwise_available(x.device, x.dtype) and self.in_features_ok(16)
                self.kind = MatmulKind.ROWWISE if ok and self.out_features % 16 == 0 \
                    else MatmulKind.DEQUANT
        return self.kind

    def in_features_ok(self, multiple: int) -> bool:
        """Whether the input width is a multiple of ``multiple`` (the kernels' tiles)."""
        return self.weight.shape[1] % multiple == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dequant(W).T + b`` through the layer's FP8 kernel."""
        return self.fp8_linear(x, self.bias)

    def fp8_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ dequant(W).T (+ bias)`` through the layer's FP8 kernel (a row-parallel
        layer adds its bias after the all-reduce: ``fp8_parallel``)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        kind = self.matmul_kind(x2)
        block = self.scheme.block if self.scheme.weights is WeightScales.BLOCK else None
        if kind is MatmulKind.DEQUANT:
            out = dequant_mm(x2, self.weight, self.weight_scale, block, bias)
        else:
            if kind is MatmulKind.BLOCKWISE:
                assert self.scheme.group_size is not None
                x8, sx = quantize_act_per_group(x2, self.scheme.group_size)
            elif self.input_scale is not None:
                x8 = quantize_act_static(x2, self.input_scale)
                sx = self.input_scale.to(torch.float32).expand(x2.shape[0], 1).contiguous()
            else:
                x8, sx = quantize_act_per_token(x2)
            if self.use_reference:
                out = reference_mm(x8, sx, self.weight, self.weight_scale, block, bias,
                                   x.dtype)
            elif kind is MatmulKind.BLOCKWISE:
                kernel = blockwise_kernel(x2.device)
                assert kernel is not None
                out = kernel(x8, sx, self.weight, self.weight_scale, x.dtype)
                if bias is not None:
                    out = out + bias
            else:
                out = rowwise_mm(x8, sx, self.weight, self.weight_scale, bias, x.dtype)
        return out.view(*lead, out.shape[-1])


class Fp8Linear(Fp8FusedLinear):
    """One linear map with FP8 weights; loads by name like ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme,
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, {"": out_features}, bias, scheme, dtype)


def _fake_quant(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized-dequantized as ``module``'s ``act`` / ``group_size`` /
    ``input_scale`` say (the CPU's emulation of its FP8 activations)."""
    acts = module.act
    if acts is ActQuant.DYNAMIC_TOKEN:
        return fake_quant_per_token(x)
    if acts is ActQuant.DYNAMIC_GROUP:
        assert module.group_size is not None
        return fake_quant_per_group(x, module.group_size)
    if acts is ActQuant.STATIC_TENSOR:
        assert module.input_scale is not None
        return fake_quant_static(x, module.input_scale)
    return x


class ActQuantFusedLinear(FusedLinear, _InputScale):
    """Stacked dense linear maps whose input is FP8-quantized-dequantized first (CPU)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool, act: ActQuant,
                 group_size: int | None) -> None:
        super().__init__(in_features, shards, bias)
        self.act = act
        self.group_size = group_size
        static = act is ActQuant.STATIC_TENSOR
        self.input_scale = _empty(1, dtype=torch.float32) if static else None
        self._input_scale_seen = set()

    def load_shard(self, shard: str, kind: str, tensor: torch.Tensor) -> None:
        """As ``FusedLinear.load_shard``, plus a shard's ``input_scale``."""
        if kind == "input_scale":
            self._load_input_scale(shard, tensor)
        else:
            super().load_shard(shard, kind, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fq(x) @ W.T + b``."""
        return linear(_fake_quant(self, x), self.weight, self.bias)


class ActQuantLinear(nn.Linear):
    """One dense linear map whose input is FP8-quantized-dequantized first (CPU)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, act: ActQuant,
                 group_size: int | None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.act = act
        self.group_size = group_size
        static = act is ActQuant.STATIC_TENSOR
        self.input_scale = _empty(1, dtype=torch.float32) if static else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fq(x) @ W.T + b``."""
        return linear(_fake_quant(self, x), self.weight, self.bias)
