"""The fused-op half of the engine's kernel self-test: each kernel of ``cuda/fused_ops.cu``
against the torch form it replaces, at the model's dtype and widths.

:func:`check_fused_ops` runs every op of :data:`~qworker.models.fused_kernels.OPS` once
through the given :class:`~qworker.models.fused_kernels.FusedKernels` (cupy on a GPU, the
CPU emulator in tests) on random rows of the model's hidden size, MLP width and head layout,
computes the same op in fp32 torch, and compares by ``||out - ref|| / ||ref||`` against
:data:`BOUNDS` (a few roundings of the dtype). :func:`passing_ops` keeps the ops that passed:
the engine routes only those to the kernels (docs/configuration.md, ``kernel_selftest``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qworker.attention.selftest import CheckResult, RecordingKernels, rel_err
from qworker.models.fused_kernels import OPS, FusedKernels
from qworker.models.ops import apply_rope

#: Relative error bounds per dtype (the kernel tests' tolerances with room).
BOUNDS: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 1.5e-2,
}

_EPS = 1e-6


@dataclass(slots=True, frozen=True)
class FusedShape:
    """The widths the fused ops see in the model."""

    dtype: torch.dtype
    hidden_size: int
    mlp_width: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def _norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _EPS))).to(x.dtype)


def _cases(shape: FusedShape, device: torch.device
           ) -> dict[str, Callable[[FusedKernels], tuple[torch.Tensor, torch.Tensor]]]:
    """Per op, a function running it through the kernels: (kernel output, torch output)."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    rows, dt = 7, shape.dtype

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dt)

    x, res = rand(rows, shape.hidden_size), rand(rows, shape.hidden_size)
    weight = (1 + 0.1 * torch.randn(shape.hidden_size, generator=gen)).to(device, dt)
    gate_up = rand(rows, 2 * shape.mlp_width, scale=2.0)
    q = rand(rows, shape.num_q_heads, shape.head_dim)
    k = rand(rows, shape.num_kv_heads, shape.head_dim)
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(device)
    half = shape.head_dim // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = freqs.cos().to(device, dt), freqs.sin().to(device, dt)

    def add_norm(f: FusedKernels) -> tuple[torch.Tensor, torch.Tensor]:
        out, summed = f.add_rms_norm(x, res, weight, _EPS)
        want_sum = x + res
        return torch.cat([out, summed]), torch.cat([_norm_ref(want_sum, weight), want_sum])

    def rotary(f: FusedKernels) -> tuple[torch.Tensor, torch.Tensor]:
        got_q, got_k = f.rotary(q.clone(), k.clone(), positions, cos, sin)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return (torch.cat([got_q.flatten(1), got_k.flatten(1)], 1),
                torch.cat([apply_rope(q, c, s).flatten(1), apply_rope(k, c, s).flatten(1)], 1))

    def silu(f: FusedKernels) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = gate_up.float().chunk(2, dim=-1)
        return f.silu_and_mul(gate_up), (F.silu(gate) * up).to(dt)

    return {
        "rms_norm": lambda f: (f.rms_norm(x, weight, _EPS), _norm_ref(x, weight)),
        "add_rms_norm": add_norm,
        "silu_and_mul": silu,
        "rotary": rotary,
    }


def check_fused_ops(fused: FusedKernels, shape: FusedShape, device: torch.device
                    ) -> list[CheckResult]:
    """One check per op of ``fused.ops`` (the kernels as they launch in the model)."""
    results = []
    for op, run in _cases(shape, device).items():
        if op not in fused.ops:
            continue
        recorder = RecordingKernels(fused.kernel_runner)
        probe = FusedKernels(recorder, emulated=fused.emulated)
        detail = f"{str(shape.dtype).removeprefix('torch.')} width {shape.hidden_size}"
        try:
            out, ref = run(probe)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            err, error = rel_err(out, ref), None
        except Exception as exc:  # a compile or launch failure fails this op only
            err, error = math.inf, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        results.append(CheckResult(op, "cuda", list(recorder.names), err, BOUNDS[shape.dtype],
                                   detail, error))
    return results


def passing_ops(fused: FusedKernels, results: list[CheckResult]) -> FusedKernels | None:
    """``fused`` limited to the ops whose check passed (None when none did)."""
    failed = {r.component for r in results if not r.passed}
    ops = frozenset(op for op in fused.ops if op not in failed)
    if not ops:
        return None
    if ops == fused.ops:
        return fused
    return FusedKernels(fused.kernel_runner, emulated=fused.emulated, ops=ops)


__all__ = ["BOUNDS", "OPS", "FusedShape", "check_fused_ops", "passing_ops"]
