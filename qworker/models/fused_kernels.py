"""Launching ``cuda/fused_ops.cu``: residual add + RMSNorm, RMSNorm, SiLU x mul, RoPE.

``qworker.models.ops`` sends its ops here when fused kernels are enabled for the
tensors' device (``enable``; the engine turns them on for a CUDA model, see
``engine_setup``), else runs the torch forms. Kernels launch on torch's current stream
(CUDA-graph safe: no host reads, no allocation outside torch) through the same kernel
cache as the attention kernels. ``kernels`` may be a CPU emulator runner
(``tests/attention/emulator``), which lets tests run the real sources on CPU tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from qworker.attention.kernel_cache import f32, i32, i64, ptr

logger = logging.getLogger(__name__)

SOURCE = "fused_ops.cu"
THREADS = 128
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KERNEL_NAMES = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_neox")


def instantiations() -> list[str]:
    """Every name expression the launcher may ask for (compile checks use this list)."""
    return [f"{k}<{c}>" for k in KERNEL_NAMES for c in sorted(set(DTYPE_CODE.values()))]


#: The ops ``qworker.models.ops`` may route here (``FusedKernels.ops``).
OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary")


class FusedKernels:
    """Launches the fused kernels for tensors on ``device`` (any device for an emulator).

    ``ops`` are the ops routed here (default all of :data:`OPS`); the engine's kernel
    self-test leaves out one whose kernel failed it, which then runs its torch form."""

    def __init__(self, kernels: Any | None = None, emulated: bool = False,
                 ops: frozenset[str] | None = None) -> None:
        if kernels is None:
            from qworker.attention.kernel_cache import KERNELS

            kernels = KERNELS
        self._kernels = kernels
        self.emulated = emulated
        self.ops = frozenset(OPS) if ops is None else frozenset(ops)

    @property
    def kernel_runner(self) -> Any:
        """The runner these kernels launch through."""
        return self._kernels

    def handles(self, x: torch.Tensor, op: str | None = None) -> bool:
        """Whether ``x`` (an activation) can go through these kernels (for ``op``, if named)."""
        return ((self.emulated or x.is_cuda) and x.dtype in DTYPE_CODE
                and (op is None or op in self.ops))

    def _launch(self, name: str, x: torch.Tensor, grid: int, args: tuple[Any, ...]) -> None:
        kernel = self._kernels.get(SOURCE, f"{name}<{DTYPE_CODE[x.dtype]}>", x.device)
        self._kernels.launch(kernel, (max(grid, 1), 1, 1), (THREADS, 1, 1), args, x.device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * norm(x)`` over the last dimension, rows of any leading shape."""
        dim = x.shape[-1]
        x2 = x.reshape(-1, dim)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        out = torch.empty((x2.shape[0], dim), dtype=x.dtype, device=x.device)
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        if x2.shape[0]:
            self._launch("rms_norm", x, x2.shape[0],
                         (ptr(out), ptr(x2), ptr(w.contiguous()), i32(dim), i64(out.stride(0)),
                          i64(x2.stride(0)), f32(eps)))
        return out.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` with the sum rounded to the dtype first."""
        dim = x.shape[-1]
        x2, r2 = x.reshape(-1, dim).contiguous(), residual.reshape(-1, dim).contiguous()
        out = torch.empty_like(x2)
        summed = torch.empty_like(x2)
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        if x2.shape[0]:
            self._launch("add_rms_norm", x, x2.shape[0],
                         (ptr(out), ptr(summed), ptr(x2), ptr(r2), ptr(w.contiguous()), i32(dim),
                          i64(dim), f32(eps)))
        return out.view(x.shape), summed.view(x.shape)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``[T, 2 * inter]``."""
        tokens, width = gate_up.shape
        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        inter = width // 2
        out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
        if tokens:
            self._launch("silu_and_mul", gate_up, tokens,
                         (ptr(out), ptr(gate_up), i32(inter), i64(out.stride(0)),
                          i64(gate_up.stride(0))))
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_table: torch.Tensor, sin_table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place (NeoX halves) by
        ``positions`` with ``[max_pos, D / 2]`` tables in their dtype; returns them."""
        tokens, q_heads, dim = q.shape
        for t in (q, k):
            if t.stride(2) != 1 or t.stride(1) != dim:
                raise ValueError("rotary kernel needs head rows of D contiguous elements")
        if tokens:
            self._launch("rotary_neox", q, tokens,
                         (ptr(q), ptr(k), ptr(cos_table), ptr(sin_table), ptr(positions),
                          i32(q_heads), i32(k.shape[1]), i32(dim), i64(q.stride(0)),
                          i64(k.stride(0))))
        return q, k


_ACTIVE: FusedKernels | None = None


def enable(kernels: FusedKernels | None) -> None:
    """Route ``qworker.models.ops`` through ``kernels`` (None: the torch forms)."""
    global _ACTIVE
    _ACTIVE = kernels


def active_for(x: torch.Tensor, op: str | None = None) -> FusedKernels | None:
    """The enabled fused kernels if they handle ``x`` (for ``op``), else None."""
    fused = _ACTIVE
    return fused if fused is not None and fused.handles(x, op) else None


def active() -> FusedKernels | None:
    """The enabled fused kernels, or None."""
    return _ACTIVE
