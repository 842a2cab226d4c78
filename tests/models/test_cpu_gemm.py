"""The packed-weight CPU kernel against ``F.linear``, and packing a whole model."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qworker import cpu_kernels
from qworker.models import cpu_gemm
from qworker.models.layers import FusedLinear, Linear
from qworker.models.ops import linear

# x86 builds beside the native one: AVX2 (8 lanes) and plain SSE2 (4 lanes) vector paths.
_MARCHES = ["native"] + (["x86-64-v3", "x86-64"] if platform.machine() == "x86_64" else [])


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu_kernels")


def _library(cache: Path, march: str) -> cpu_kernels.CpuKernels:
    kernels = cpu_kernels.load(cache, march)
    if kernels is None:
        pytest.skip("no C compiler here: the models keep F.linear (tests/cpu_kernels)")
    return kernels


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
           bias: torch.Tensor | None = None) -> None:
    """Within the fp32 bound of any summation order: ``|err| <= k u sum |x_i w_i|``
    (u = 2^-24; bias added last, one more rounding)."""
    x64, w64 = x.double(), w.double()
    exact = F.linear(x64, w64, None if bias is None else bias.double())
    terms = F.linear(x64.abs(), w64.abs())
    if bias is not None:
        terms = terms + bias.double().abs()
    k = x.shape[-1] + 1
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= k * 2.0**-24 * terms + 1e-30).all()


@pytest.mark.parametrize("march", _MARCHES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 64, 16), (9, 960, 576), (7, 100, 33), (6, 1, 5), (13, 129, 1100), (40, 70, 64)],
)
def test_gemm_matches_torch_linear_for_any_shape(kernel_cache: Path, march: str, m: int,
                                                   n: int, k: int) -> None:
    library = _library(kernel_cache, march)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = cpu_gemm.pack(library, w)
    _check(packed.linear(x), x, w)
    _check(packed.linear(x, bias), x, w, bias)
    # and as close to the BLAS as two fp32 summation orders can be
    assert torch.allclose(packed.linear(x, bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4)


def test_kernel_takes_strided_rows_leading_dims_and_empty_batches(kernel_cache: Path) -> None:
    library = _library(kernel_cache, "native")
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 40, generator=gen)
    packed = cpu_gemm.pack(library, w.t().contiguous().t())  # a column-major weight packs too
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 10:50]  # rows 100 floats apart
    _check(packed.linear(x), x, w)
    x3 = torch.randn(2, 3, 40, generator=gen)
    assert packed.linear(x3).shape == (2, 3, 96)
    _check(packed.linear(x3), x3, w)
    assert packed.linear(torch.empty(0, 40)).shape == (0, 96)


def test_packed_model_linears_compute_the_same_and_free_their_weights(kernel_cache: Path
                                                                      ) -> None:
    library = _library(kernel_cache, "native")
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 24)
    model = torch.nn.ModuleDict({
        "embed": embed,
        "qkv": FusedLinear(24, {"q": 24, "k": 8, "v": 8}, bias=True),
        "down": Linear(24, 24, bias=False),
        "head": Linear(24, 50, bias=False),
    })
    for p in model.parameters():
        torch.nn.init.normal_(p)
    model["head"].weight = embed.weight  # tied, as the LM heads of small models are
    x = torch.randn(4, 24)
    weights = {name: (model[name].weight.clone(), model[name].bias)
               for name in ("qkv", "down", "head")}
    packed_bytes = cpu_gemm.pack_model(model, library)
    assert packed_bytes > 0
    for name, (w, b) in weights.items():
        _check(model[name](x), x, w, b)
    assert model["qkv"].weight.numel() == 0  # only the packed copy is kept
    assert model["down"].weight.numel() == 0
    assert model["head"].weight.shape == (50, 24)  # the embedding still looks rows up
    assert embed(torch.tensor([3])).shape == (1, 24)


def test_linear_keeps_torch_for_unpacked_weights_and_other_dtypes(kernel_cache: Path) -> None:
    library = _library(kernel_cache, "native")
    w = torch.randn(16, 8)
    x = torch.randn(3, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))  # never packed
    layer = Linear(8, 16)
    cpu_gemm.pack_model(layer, library)
    assert cpu_gemm.packed_of(layer.weight) is not None
    with pytest.raises(RuntimeError):  # a bf16 input cannot use the fp32 panels...
        linear(x.bfloat16(), layer.weight)  # ...and the released weight fails loudly


