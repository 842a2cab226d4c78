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
@pytest.mark.parametrize("kernels", [True, False], ids=["c-decode", "torch-decode"])
def test_forward_matches_the_reference(q_lens: list[int], seq_lens: list[int], q_heads: int,
                                       kv_heads: int, dim: int, block: int,
                                       window: int | None, dtype: torch.dtype,
                                       kernels: bool) -> None:
    batch = make_batch(q_lens, seq_lens, q_heads, kv_heads, dim, block, dtype,
                       sliding_window=window, seed=len(q_lens) + dim)
    scale = dim**-0.5
    ref = REF.forward(batch.query, batch.key_cache, batch.value_cache, batch.meta, scale)
    out = CpuAttentionBackend(kernels).forward(batch.query, batch.key_cache, batch.value_cache,
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


@pytest.mark.parametrize("kernels", [True, False], ids=["c-decode", "torch-decode"])
def test_per_window_plans_of_one_step_do_not_mix(kernels: bool) -> None:
    # Qwen2-style: the same step's metadata with and without a window, alternating layers.
    batch = make_batch([1, 12], [40, 12], 4, 2, 16, 8, torch.float32, seed=4)
    windowed = dataclasses.replace(batch.meta, sliding_window=4)
    backend = CpuAttentionBackend(kernels)
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


def test_c_decode_reads_no_slot_past_a_sequence_and_matches_on_threads() -> None:
    from qworker import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler here: the torch decode runs (tested above)")
    batch = make_batch([1] * 12, [3 + 11 * i for i in range(12)], 8, 2, 64, 16, torch.float32,
                       seed=11)
    # every cache slot no sequence owns is NaN: one read of it would poison an output
    args = (batch.query, batch.key_cache, batch.value_cache, batch.meta, 0.125)
    ref = REF.forward(*args)
    before = kernels.threads
    try:
        kernels.set_threads(1)
        alone = CpuAttentionBackend().forward(*args)
        kernels.set_threads(3)
        shared = CpuAttentionBackend().forward(*args)
    finally:
        kernels.set_threads(before)
    assert torch.isfinite(alone).all()
    assert rel_err(alone, ref) < TOLERANCE[torch.float32]
    assert torch.equal(alone, shared)


CAPPED_CASES = [
    # q_lens, seq_lens (decodes first), q_heads, kv_heads, head_dim, block_size, window, cap
    pytest.param([1, 1, 1], [1, 9, 40], 4, 2, 16, 8, None, 1.5, id="decodes-cap"),
    pytest.param([1, 1, 7, 20], [33, 64, 30, 20], 8, 2, 32, 16, 9, 2.0, id="mixed-window-cap"),
    pytest.param([1, 12], [70, 12], 6, 1, 64, 8, 3, 0.5, id="window-3-tiny-cap"),
]


@pytest.mark.parametrize(("q_lens", "seq_lens", "q_heads", "kv_heads", "dim", "block", "window",
                          "cap"), CAPPED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [True, False], ids=["c-decode", "torch-decode"])
def test_soft_capped_layers_match_the_reference(q_lens: list[int], seq_lens: list[int],
                                                q_heads: int, kv_heads: int, dim: int,
                                                block: int, window: int | None, cap: float,
                                                dtype: torch.dtype, kernels: bool) -> None:
    batch = make_batch(q_lens, seq_lens, q_heads, kv_heads, dim, block, dtype,
                       sliding_window=window, logits_soft_cap=cap, seed=dim + len(q_lens))
    scale = 0.5  # not head_dim ** -0.5; scores of several units, so the cap bites
    args = (batch.query, batch.key_cache, batch.value_cache)
    ref = REF.forward(*args, batch.meta, scale)
    out = CpuAttentionBackend(kernels).forward(*args, batch.meta, scale)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    uncapped = REF.forward(*args, dataclasses.replace(batch.meta, logits_soft_cap=None), scale)
    assert rel_err(uncapped, ref) > 10 * TOLERANCE[dtype]  # the cap changed the answer


@pytest.mark.parametrize("kernels", [True, False], ids=["c-decode", "torch-decode"])
def test_per_layer_window_and_cap_plans_of_one_step_do_not_mix(kernels: bool) -> None:
    # Gemma-style: one step's metadata as windowed + capped, global + capped and plain
    # layers see it, alternating; each must get its own answer every time.
    batch = make_batch([1, 1, 12], [40, 9, 12], 4, 2, 16, 8, torch.float32, seed=14)
    variants = [dataclasses.replace(batch.meta, sliding_window=w, logits_soft_cap=c)
                for w, c in ((4, 1.0), (None, 1.0), (None, None), (4, None))]
    backend = CpuAttentionBackend(kernels)
    args = (batch.query, batch.key_cache, batch.value_cache)
    outs = []
    for _ in range(2):
        outs = [backend.forward(*args, meta, 0.7) for meta in variants]
        for meta, out in zip(variants, outs, strict=True):
            assert rel_err(out, REF.forward(*args, meta, 0.7)) < 1e-5
    assert min(rel_err(a, b) for i, a in enumerate(outs) for b in outs[i + 1:]) > 1e-3
