"""The tensor-core paged prefill kernel (``cuda/paged_prefill_tc.cu``) on the CPU emulator,
behind the backend's launch code, against the torch reference: chunks over cached prefixes
(prefix hits, chunked prefill), fresh prompts, single-token chunks after the prefill rows,
GQA packing (groups 1..8, not only powers of two), sliding windows, block sizes 8/16/32,
head sizes 32..256, the FP8 cache, and decodes in the same step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.cuda_kernels import DTYPE_CODE, PREFILL_TC_MAX_HEAD, prefill_choice
from qworker.attention.torch_ref import TorchAttentionBackend
from tests.attention.cases import TOLERANCE, make_batch, rel_err
from tests.attention.conftest import EMU_TC_PREFILL
from tests.attention.test_decode_tc import fp8_batch

REF = TorchAttentionBackend()

PREFILL_CASES = [
    # dtype, kv8, head_dim, q_heads, kv_heads, block_size, window, q_lens, seq_lens
    (torch.bfloat16, False, 64, 8, 2, 16, None, [5, 17, 40, 1], [40, 17, 90, 70]),
    (torch.float16, False, 80, 7, 7, 8, None, [30, 3], [30, 50]),  # MHA, 5 k steps
    (torch.bfloat16, False, 128, 12, 2, 32, 20, [33, 9], [100, 9]),  # group 6, window
    (torch.float16, False, 32, 3, 1, 16, 7, [70], [75]),  # group 3, tight window
    (torch.bfloat16, False, 256, 2, 1, 16, None, [19, 6], [25, 6]),  # head 256: via SDPA
    (torch.bfloat16, True, 64, 16, 2, 16, None, [20, 4], [60, 4]),  # FP8, group 8
    (torch.float16, True, 80, 4, 4, 8, 16, [24], [61]),  # FP8, odd k steps, window
    (torch.bfloat16, True, 112, 8, 1, 32, None, [9, 13], [80, 13]),  # FP8, 7 k steps, MQA
]


@pytest.mark.parametrize(
    ("dtype", "kv8", "dim", "q_heads", "kv_heads", "block_size", "window", "q_lens", "lens"),
    PREFILL_CASES,
)
def test_emulated_tc_prefill_matches_reference(  # type: ignore[no-untyped-def]
    emu_kernels, dtype, kv8, dim, q_heads, kv_heads, block_size, window, q_lens, lens
) -> None:
    assert dim > PREFILL_TC_MAX_HEAD or (DTYPE_CODE[dtype], int(kv8), dim) in EMU_TC_PREFILL
    batch = make_batch(q_lens, lens, q_heads, kv_heads, dim, block_size, dtype,
                       sliding_window=window, seed=dim + q_heads, pad_tokens=2)  # fmt: skip
    scales = None
    if kv8:
        batch, scales = fp8_batch(batch)
    backend = CudaAttentionBackend(kernels=emu_kernels(), num_sms=4, prefill="paged")
    scale = dim**-0.5
    out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale,
                          kv_scales=scales)  # fmt: skip
    assert backend.last_prefill == ("paged" if dim <= PREFILL_TC_MAX_HEAD else "sdpa")
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale,
                      kv_scales=scales)  # fmt: skip
    real = slice(0, batch.meta.num_tokens - 2)
    assert rel_err(out, ref, real) < TOLERANCE[dtype]


CAPPED_PREFILL_CASES = [
    # dtype, kv8, head_dim, q_heads, kv_heads, block_size, window, cap, q_lens, seq_lens
    (torch.bfloat16, False, 64, 8, 2, 16, 13, 1.5, [5, 17, 40, 1], [40, 17, 90, 70]),
    (torch.float16, False, 80, 7, 7, 8, None, 0.75, [19, 3], [19, 40]),
    (torch.bfloat16, True, 64, 16, 2, 16, 9, 2.0, [20, 4], [60, 4]),  # FP8
    (torch.bfloat16, False, 256, 2, 1, 16, 5, 1.0, [19, 6], [25, 6]),  # head 256: via SDPA
]


@pytest.mark.parametrize(
    ("dtype", "kv8", "dim", "q_heads", "kv_heads", "block_size", "window", "cap", "q_lens",
     "lens"),
    CAPPED_PREFILL_CASES,
)
def test_emulated_tc_prefill_soft_cap_matches_reference(  # type: ignore[no-untyped-def]
    emu_kernels, dtype, kv8, dim, q_heads, kv_heads, block_size, window, cap, q_lens, lens
) -> None:
    assert dim > PREFILL_TC_MAX_HEAD or (DTYPE_CODE[dtype], int(kv8), dim, 1) in EMU_TC_PREFILL
    batch = make_batch(q_lens, lens, q_heads, kv_heads, dim, block_size, dtype,
                       sliding_window=window, logits_soft_cap=cap, seed=dim + 3,
                       pad_tokens=2)  # fmt: skip
    scales = None
    if kv8:
        batch, scales = fp8_batch(batch)
    kernels = emu_kernels()
    backend = CudaAttentionBackend(kernels=kernels, num_sms=4, prefill="paged")
    scale = 0.4  # not head_dim ** -0.5: scores of several units, so the cap bites
    args = (batch.query, batch.key_cache, batch.value_cache)
    out = backend.forward(*args, batch.meta, scale, kv_scales=scales)
    assert backend.last_prefill == ("paged" if dim <= PREFILL_TC_MAX_HEAD else "sdpa")
    assert all(name.endswith(", 1>") for name in kernels.launches)  # capped instantiations
    ref = REF.forward(*args, batch.meta, scale, kv_scales=scales)
    real = slice(0, batch.meta.num_tokens - 2)
    assert rel_err(out, ref, real) < TOLERANCE[dtype]
    uncapped = dataclasses.replace(batch.meta, logits_soft_cap=None)
    assert rel_err(REF.forward(*args, uncapped, scale, kv_scales=scales), ref, real) > 0.05


def test_emulated_step_with_decodes_and_prefills_in_one_forward(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch([1, 1, 1, 6, 37, 2], [1, 70, 33, 50, 37, 200], 8, 2, 64, 16,
                       torch.bfloat16, pad_tokens=3, seed=8)  # fmt: skip
    for prefill in ("paged", "sdpa", "auto"):
        backend = CudaAttentionBackend(kernels=emu_kernels(), num_sms=4, prefill=prefill)
        out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
        ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
        assert rel_err(out, ref, slice(0, batch.meta.num_tokens - 3)) < TOLERANCE[torch.bfloat16]
        assert backend.last_decode is not None and backend.last_decode.name.startswith(
            "paged_decode_tc"
        )


def test_prefill_tile_table_covers_every_row_once_longest_first(emu_kernels) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch([1, 100, 3, 64], [9, 300, 3, 64], 8, 2, 64, 16, torch.bfloat16)
    backend = CudaAttentionBackend(kernels=emu_kernels(), num_sms=4)
    starts, lens = backend._host_lists(batch.meta)
    table = backend._tc.prefill_tiles(batch.meta, starts, lens, 4, torch.device("cpu"))
    tiles = [tuple(t) for t in table.tolist()]
    rows = {1: 400, 2: 12, 3: 256}  # q_len * group per prefill sequence
    assert sorted(tiles) == sorted((s, r) for s, n in rows.items() for r in range(0, n, 64))
    assert tiles[0] == (1, 384)  # the rows that see the most context come first


def test_prefill_choice_rule() -> None:
    assert prefill_choice(4, 2048) == "paged"  # several sequences: one launch beats a loop
    assert prefill_choice(1, 512) == "paged"
    assert prefill_choice(1, 8192) == "sdpa"  # one long chunk: FlashAttention via SDPA


@pytest.mark.gpu
@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize("dim", [64, 80, 128, 160])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_tc_prefill_matches_reference(dtype: torch.dtype, dim: int, kv8: bool) -> None:
    failures = []
    for (q_heads, kv_heads), block_size, window in (
        ((32, 8), 16, None),
        ((8, 8), 8, 500),
        ((16, 1), 32, None),
        ((28, 4), 16, 1000),
    ):
        batch = make_batch([1, 1, 37, 300, 5, 700], [1, 700, 500, 300, 4000, 2000], q_heads,
                           kv_heads, dim, block_size, dtype, "cuda", sliding_window=window,
                           pad_tokens=5, seed=q_heads + dim)  # fmt: skip
        scales = None
        if kv8:
            batch, scales = fp8_batch(batch)
        backend = CudaAttentionBackend(prefill="paged")
        out = backend.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.09,
                              kv_scales=scales)  # fmt: skip
        assert backend.last_prefill == "paged"
        ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.09,
                          kv_scales=scales)  # fmt: skip
        err = rel_err(out, ref, slice(0, batch.meta.num_tokens - 5))
        if not err < TOLERANCE[dtype]:
            failures.append((q_heads, kv_heads, block_size, window, err))
    assert not failures, failures
