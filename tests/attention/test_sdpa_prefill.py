"""Gather + SDPA prefill agrees with the torch reference (it runs on the CPU too)."""

from __future__ import annotations

import pytest
import torch

from qworker.attention.sdpa_prefill import gather_context, sdpa_prefill
from qworker.attention.torch_ref import TorchAttentionBackend
from tests.attention.cases import TOLERANCE, make_batch, rel_err


def _run(batch, first_seq: int, scale: float | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    meta = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    sdpa_prefill(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        meta.block_tables,
        meta.query_start_loc.tolist(),
        meta.seq_lens.tolist(),
        first_seq,
        batch.query.shape[-1] ** -0.5 if scale is None else scale,
        out,
        meta.sliding_window,
        soft_cap=meta.logits_soft_cap,
    )
    return out


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "block_size"), [(4, 4, 8), (8, 2, 16), (6, 1, 32), (7, 7, 16)]
)
def test_prefill_over_cached_context_matches_reference(
    q_heads: int, kv_heads: int, block_size: int
) -> None:
    # Chunks over cached prefixes (bottom-right causal), a fresh prompt, and a single-token
    # chunk that is not a decode because it follows the prefill rows.
    batch = make_batch(
        [5, 17, 9, 1],
        [40, 17, 9 + 3 * block_size, 70],
        q_heads,
        kv_heads,
        32,
        block_size,
        torch.float32,
        pad_tokens=2,
    )
    scale = 32**-0.5
    ref = TorchAttentionBackend().forward(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, scale
    )
    out = _run(batch, 0)
    real = slice(0, batch.meta.num_tokens - 2)
    assert rel_err(out, ref, real) < 1e-5


def test_prefill_skips_decode_rows_and_honours_sliding_window() -> None:
    batch = make_batch(
        [1, 1, 12, 30], [50, 9, 60, 30], 8, 2, 64, 16, torch.float32, sliding_window=20
    )
    ref = TorchAttentionBackend().forward(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125
    )
    out = _run(batch, batch.meta.num_decodes)
    assert torch.isnan(out[:2]).all()  # decode rows are left to the decode kernel
    assert rel_err(out, ref, slice(2, None)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_in_half_precision_stays_within_rounding(dtype: torch.dtype) -> None:
    batch = make_batch([8, 20], [24, 20], 4, 2, 64, 8, dtype)
    ref = TorchAttentionBackend().forward(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125
    )
    assert rel_err(_run(batch, 0), ref) < TOLERANCE[dtype]


def test_gather_context_follows_the_block_table() -> None:
    cache = torch.arange(5 * 2 * 4 * 3, dtype=torch.float32).view(5, 2, 4, 3)
    table = torch.tensor([3, 1, 4, 0], dtype=torch.int32)
    got = gather_context(cache, table, 6)
    assert got.shape == (2, 6, 3)
    assert torch.equal(got[:, :4], cache[3])
    assert torch.equal(got[:, 4:6], cache[1, :, :2])


@pytest.mark.parametrize("rows_per_chunk", [None, 3], ids=["one-chunk", "3-row-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 11])
def test_soft_capped_prefill_takes_the_explicit_path_and_matches_reference(
    dtype: torch.dtype, window: int | None, rows_per_chunk: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import qworker.attention.sdpa_prefill as sdpa

    batch = make_batch([1, 9, 30, 1], [40, 50, 30, 66], 8, 2, 32, 16, dtype,
                       sliding_window=window, logits_soft_cap=1.25, seed=31)
    if rows_per_chunk is not None:  # force the query rows through several score chunks
        monkeypatch.setattr(sdpa, "CAPPED_SCORE_ELEMS", rows_per_chunk * 8 * 66)
    ref = TorchAttentionBackend().forward(
        batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.5
    )
    out = _run(batch, 1, scale=0.5)
    assert torch.isnan(out[:1]).all()
    assert rel_err(out, ref, slice(1, None)) < TOLERANCE[dtype]
