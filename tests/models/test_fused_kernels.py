"""cuda/fused_ops.cu against the torch forms of qworker.models.ops.

On the CPU the real sources run in the kernel emulator (tests/attention/emulator) behind
the launcher's own argument packing; NVRTC compiles every instantiation for sm_90; on a
GPU (``-m gpu``) the cupy-compiled kernels run. A whole model forward with the fused
kernels matches the torch forms, so parity with transformers carries over.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qworker.attention.cuda_kernels import CUDA_DIR
from qworker.models import fused_kernels, ops
from qworker.models.fused_kernels import FusedKernels, instantiations

HERE = Path(__file__).resolve().parent
EMU_DIR = HERE.parent / "attention" / "emulator"
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _build() -> ctypes.CDLL:
    from tests.attention.emulator import compiler

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    digest = hashlib.sha256()
    for path in (EMU_DIR / "cuda_emu.h", HERE / "fused_emu.cpp", CUDA_DIR / "fused_ops.cu"):
        digest.update(path.read_bytes())
    lib = Path(tempfile.gettempdir()) / f"qworker_fused_emu_{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{id(digest)}.so")
        subprocess.run([compiler() or "g++", "-std=c++20", "-O1", "-g0", "-shared", "-fPIC",
                        "-pthread", "-x", "c++", str(HERE / "fused_emu.cpp"), f"-I{EMU_DIR}",
                        f"-I{CUDA_DIR}", "-o", str(tmp)], check=True, capture_output=True)
        tmp.replace(lib)
    dll = ctypes.CDLL(str(lib))
    dll.qw_emu_run.restype = ctypes.c_int
    return dll


@pytest.fixture(scope="module")
def fused() -> FusedKernels:
    from tests.attention.emulator import EmulatedKernels

    return FusedKernels(kernels=EmulatedKernels(_build()), emulated=True)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
    assert float(err) < TOL[got.dtype], float(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norms_and_activation_match_the_torch_forms(fused: FusedKernels,
                                                    dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 200, generator=gen).to(dtype)
    r = torch.randn(5, 200, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    _close(fused.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    got_out, got_sum = fused.add_rms_norm(x, r, w, 1e-6)
    want_out, want_sum = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(got_sum, want_sum)  # the residual sum is exact in every dtype
    _close(got_out, want_out)
    heads = torch.randn(3, 4, 32, generator=gen).to(dtype)  # Qwen3's per-head q/k norm
    _close(fused.rms_norm(heads, w[:32], 1e-6), ops.rms_norm(heads, w[:32], 1e-6))
    gate_up = torch.randn(4, 2 * 150, generator=gen).to(dtype)
    _close(fused.silu_and_mul(gate_up), ops.gated_act(gate_up, F.silu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_torch_form_in_place_on_projection_views(
    fused: FusedKernels, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, q_heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.arange(50).float()[:, None] * (0.7 ** torch.arange(dim // 2).float())
    tables = (angles.cos().to(dtype), angles.sin().to(dtype))
    positions = torch.tensor([0, 5, 6, 7, 30, 49])
    want_q, want_k = ops.rotate_qk(q.clone(), k.clone(), positions, tables, [])
    v_before = qkv[:, (q_heads + kv_heads) * dim :].clone()
    got_q, got_k = fused.rotary(q, k, positions, *tables)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_a_model_forward_with_fused_kernels_matches_the_torch_ops(
    fixture: str, request: pytest.FixtureRequest, fused: FusedKernels
) -> None:
    from qworker.models.loader import load_model
    from tests.models.paged import PagedRunner

    loaded = load_model(request.getfixturevalue(fixture), torch.float32, "cpu")
    prompt = list(range(5, 17))
    want = PagedRunner(loaded.model).step({0: prompt})[0]
    fused_kernels.enable(fused)
    try:
        launches_before = len(fused._kernels.launches)
        got = PagedRunner(loaded.model).step({0: prompt})[0]
        launched = set(fused._kernels.launches[launches_before:])
    finally:
        fused_kernels.enable(None)
    assert {"rms_norm<0>", "add_rms_norm<0>", "silu_and_mul<0>", "rotary_neox<0>"} <= launched
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_instantiation_compiles_with_nvrtc() -> None:
    from qworker.attention.nvrtc import compile_only, nvrtc_version

    if nvrtc_version() is None:
        pytest.skip("cupy / libnvrtc not installed")
    names = instantiations()
    result = compile_only((CUDA_DIR / "fused_ops.cu").read_text(), names, filename="fused_ops.cu")
    assert set(result.lowered) == set(names)
    assert all(not r.stack_frame and not r.spill_stores for r in result.resources.values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_on_the_gpu_match_the_torch_forms(dtype: torch.dtype) -> None:
    fused = FusedKernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 4096, generator=gen, device="cuda").to(dtype)
    r = torch.randn(33, 4096, generator=gen, device="cuda").to(dtype)
    w = torch.randn(4096, generator=gen, device="cuda").to(dtype)
    _close(fused.add_rms_norm(x, r, w, 1e-5)[0], ops.add_rms_norm(x, r, w, 1e-5)[0])
    gate_up = torch.randn(33, 2 * 14336, generator=gen, device="cuda").to(dtype)
    _close(fused.silu_and_mul(gate_up), ops.gated_act(gate_up, F.silu))
