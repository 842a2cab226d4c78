"""``select_backend`` names a backend only for what runs: without CuPy "auto" on a GPU device
is the torch reference (with a warning) and "cuda" is refused naming CuPy, instead of a CUDA
backend that silently runs torch code while stats say "cuda"."""

from __future__ import annotations

import logging

import pytest
import torch

import qworker.attention.select as select
from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.select import select_backend
from qworker.attention.torch_ref import TorchAttentionBackend

GPU = torch.device("cuda")  # a device object only: nothing here touches a GPU


def test_without_cupy_auto_is_the_reference_and_cuda_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(select, "cupy_import_error", lambda: "ModuleNotFoundError: cupy")
    with caplog.at_level(logging.WARNING, logger="qworker.attention.select"):
        backend = select_backend("auto", GPU)
    assert isinstance(backend, TorchAttentionBackend) and backend.name == "torch"
    assert any("CuPy does not import" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"attention_backend='cuda' needs CuPy.*cupy"):
        select_backend("cuda", GPU)


def test_with_cupy_a_gpu_gets_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "cupy_import_error", lambda: None)
    assert isinstance(select_backend("auto", GPU), CudaAttentionBackend)
    assert isinstance(select_backend("cuda", GPU), CudaAttentionBackend)


def test_other_names_and_devices() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu), CpuAttentionBackend)
    assert isinstance(select_backend("torch", GPU), TorchAttentionBackend)
    with pytest.raises(ValueError, match="needs device='cuda'"):
        select_backend("cuda", cpu)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("triton", cpu)
    injected = select_backend("auto", cpu, kernels=object())  # type: ignore[arg-type]
    assert isinstance(injected, CudaAttentionBackend) and injected.kernel_runner is not None
