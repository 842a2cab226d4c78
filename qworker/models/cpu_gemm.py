"""The CPU's fp32 linear layers through ``qworker/cpu_kernels/gemm.c``: weights packed once.

On the CPU a decode step's matmuls are skinny (a few rows of activations against every
weight) and the BLAS behind ``F.linear`` streams nn.Linear's row-major weights poorly
at that shape; packing each weight once into contiguous column panels and running a
small register-tiled kernel over them made the matmuls of a 9-sequence SmolLM2-135M
decode step 2.6x faster, and prefill-sized ones ~1.2x (docs/benchmarks.md).

``pack_model`` packs every fp32 ``nn.Linear``/``FusedLinear`` weight of a model on the
CPU and attaches the packed form to the weight tensor (``PACKED_ATTR``); ``ops.linear``
uses it. A weight no embedding shares is then released (only the packed copy stays),
so packing costs no memory beyond a tied LM head's second layout. Each output is one
fp32 sum over k in order, bias last (``gemm.c``); the engine's tests hold the greedy
tokens to transformers' (tests/engine/test_llm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qworker.cpu_kernels import CpuKernels

#: Attribute of a weight tensor holding its ``PackedWeight``.
PACKED_ATTR = "qw_packed"


def pack(kernels: CpuKernels, weight: torch.Tensor) -> PackedWeight:
    """Pack a CPU fp32 ``[N, K]`` weight (any row stride) into ``kernels``' panels."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape "
                         f"{tuple(weight.shape)} on {weight.device}")
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    n, k = w.shape
    width = kernels.panel_width
    panels = torch.empty(-(-n // width) * k * width, dtype=torch.float32)
    kernels.lib.qw_gemm_pack(w.data_ptr(), n, k, w.stride(0), panels.data_ptr())
    return PackedWeight(kernels, panels, n, k)


@dataclass(slots=True)
class PackedWeight:
    """One weight ``[n, k]`` in ``kernels``' column panels."""

    kernels: CpuKernels
    panels: torch.Tensor
    n: int
    k: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` for fp32 ``x`` of shape ``[..., k]`` (any thread; calls
        made while another runs use their own thread alone)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], self.n), dtype=torch.float32)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        if x2.shape[0]:
            self.kernels.lib.qw_gemm_parallel(
                x2.data_ptr(), x2.shape[0], x2.stride(0), self.panels.data_ptr(), self.n,
                self.k, None if bias is None else bias.data_ptr(), out.data_ptr(), self.n)
        return out.view(*lead, self.n)


def packed_of(weight: torch.Tensor) -> PackedWeight | None:
    """The packed form attached to ``weight`` by ``pack_model``, if any."""
    return getattr(weight, PACKED_ATTR, None)


def pack_model(model: nn.Module, kernels: CpuKernels) -> int:
    """Pack every fp32 CPU linear weight of ``model`` (``nn.Linear`` and modules with a
    2-D ``weight`` and ``out_features``, such as ``FusedLinear``); returns bytes packed.

    Weights an ``nn.Embedding`` shares (a tied LM head) keep their storage for the
    lookup; the others keep only the packed copy (their tensor becomes empty, so a
    stray ``F.linear`` on it fails loudly instead of computing with stale values).
    """
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or id(weight) in seen:
            continue
        if not (isinstance(module, nn.Linear) or hasattr(module, "out_features")):
            continue
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        seen.add(id(weight))
        packed = pack(kernels, weight.detach())
        setattr(weight, PACKED_ATTR, packed)
        total += packed.panels.numel() * 4
        if id(weight) not in shared:
            weight.data = weight.data.new_empty((0,))
    return total
