"""The batched CPU backend against the torch reference: every head size, GQA ratio,
window, block size and decode/prefill/chunk mix, cache writes included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.torch_ref import TorchAttentionBackend
from tests.attention.cases import TOLERANCE, make_batch, rel_err

REF = TorchAttentionBackend()

CASES = [
    # q_lens, seq_lens (decodes first), q_heads, kv_heads, head_dim, block_size, window
    pytest.param([1, 1, 1], [1, 9, 40], 4, 4, 16, 8, None, id="decodes-mha-partial-blocks"),
    pytest.param([1, 1], [17, 130], 8, 1, 32, 16, None, id="decodes-mqa"),
    pytest.param([5], [5], 4, 2, 64, 16, None, id="one-prompt-no-cache"),
    pytest.param([7, 20], [30, 20], 6, 2, 80, 8, None, id="chunk-over-cache-and-prompt"),
    pytest.param([1, 1, 6, 33], [12, 70, 6, 90], 8, 2, 128, 16, None, id="mixed-gqa4"),
    pytest.param([1, 4, 16], [50, 60, 16], 16, 2, 16, 32, 7, id="window-gqa8"),
    pytest.param([1, 1, 9], [3, 40, 25], 14, 2, 32, 8, 5, id="window-group7"),
    pytest.param([1], [1], 2, 1, 256, 16, None, id="head256-first-token"),
]


@pytest.mark.parametrize(("q_lens", "seq_lens", "q_heads", "kv_heads", "dim", "block", "window"),
                         CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_the_reference(q_lens: list[int], seq_lens: list[int], q_heads: int,
                                       kv_heads: int, dim: int, block: int,
                                       window: int | None, dtype: torch.dtype) -> None:
    batch = make_batch(q_lens, seq_lens, q_heads, kv_heads, dim, block, dtype,
                       sliding_window=window, seed=len(q_lens) + dim)
    scale = dim**-0.5
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    out = CpuAttentionBackend().forward(batch.query, batch.key_cache, batch.value_cache,
                                        batch.meta, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_host_lists_in_metadata_give_the_same_result() -> None:
    batch = make_batch([1, 3, 8], [20, 9, 30], 4, 2, 32, 8, torch.float32, seed=3)
    meta = batch.meta
    with_host = dataclasses.replace(meta, host_query_start_loc=meta.query_start_loc.tolist(),
                                    host_seq_lens=meta.seq_lens.tolist())
    backend = CpuAttentionBackend()
    a = backend.forward(batch.query, batch.key_cache, batch.value_cache, meta, 0.3)
    b = CpuAttentionBackend().forward(batch.query, batch.key_cache, batch.value_cache,
                                      with_host, 0.3)
    assert torch.equal(a, b)


def test_per_window_plans_of_one_step_do_not_mix() -> None:
    # Qwen2-style: the same step's metadata with and without a window, alternating layers.
    batch = make_batch([1, 12], [40, 12], 4, 2, 16, 8, torch.float32, seed=4)
    windowed = dataclasses.replace(batch.meta, sliding_window=4)
    backend = CpuAttentionBackend()
    args = (batch.query, batch.key_cache, batch.value_cache)
    for _ in range(2):
        full = backend.forward(*args, batch.meta, 0.25)
        win = backend.forward(*args, windowed, 0.25)
        assert rel_err(full, REF.forward(*args, batch.meta, 0.25)) < 1e-5
        assert rel_err(win, REF.forward(*args, windowed, 0.25)) < 1e-5
    assert rel_err(full, win) > 1e-3


@pytest.mark.parametrize("pad", [0, 3])
def test_write_kv_matches_the_reference_and_skips_padding_slots(pad: int) -> None:
    batch = make_batch([1, 5], [9, 5], 4, 2, 16, 8, torch.float32, pad_tokens=pad, seed=5)
    ref_k, ref_v = batch.key_cache.clone(), batch.value_cache.clone()
    REF.write_kv(batch.new_key, batch.new_value, ref_k, ref_v, batch.meta.slot_mapping)
    CpuAttentionBackend().write_kv(batch.new_key, batch.new_value, batch.key_cache,
                                   batch.value_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.key_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0))
    assert torch.equal(batch.value_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
