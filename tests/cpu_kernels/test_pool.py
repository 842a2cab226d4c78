"""The kernels' work-sharing pool: any thread count gives the same bits; concurrent
callers (and a caller while the pool is busy) each get their own result."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qworker import cpu_kernels
from qworker.models.cpu_gemm import pack


def _kernels(cache: Path) -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load(cache)
    if kernels is None:
        pytest.skip("no C compiler here")
    return kernels


def test_threads_share_the_work_without_changing_a_bit(kernel_cache: Path) -> None:
    kernels = _kernels(kernel_cache)
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(3000, 300, generator=gen)
    packed = pack(kernels, w)
    xs = [torch.randn(m, 300, generator=gen) for m in (1, 9, 70)]
    try:
        kernels.set_threads(1)
        alone = [packed.linear(x) for x in xs]
        assert kernels.set_threads(3) == 3
        for _ in range(3):
            for x, want in zip(xs, alone, strict=True):
                assert torch.equal(packed.linear(x), want)
        assert kernels.set_threads(2) == 2  # fewer helpers: stopped and restarted
        assert torch.equal(packed.linear(xs[1]), alone[1])
    finally:
        kernels.set_threads(1)


def test_concurrent_callers_each_get_their_own_result(kernel_cache: Path) -> None:
    kernels = _kernels(kernel_cache)
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(2048, 128, generator=gen)
    packed = pack(kernels, w)
    xs = [torch.randn(16, 128, generator=gen) for _ in range(4)]
    want = [F.linear(x, w) for x in xs]
    failures: list[int] = []

    def call(i: int) -> None:
        for _ in range(20):
            if not torch.allclose(packed.linear(xs[i]), want[i], rtol=1e-4, atol=1e-4):
                failures.append(i)

    try:
        kernels.set_threads(2)
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        kernels.set_threads(1)
    assert failures == []
