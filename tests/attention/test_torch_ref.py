"""The torch reference itself against transformers' own attention: Gemma 2's eager attention
(soft-cap, query_pre_attn_scalar scale, GQA) under transformers' causal and sliding-window
mask functions, for prompts and for chunks over a cached prefix. Every other backend is
tested against this reference, so it is pinned to code nobody here wrote."""

from __future__ import annotations

import types

import pytest
import torch

from qworker.attention.sdpa_prefill import gather_context
from qworker.attention.torch_ref import TorchAttentionBackend
from tests.attention.cases import make_batch


def _transformers_attention(batch, seq: int, scale: float, window: int | None,  # type: ignore[no-untyped-def]
                            cap: float | None) -> torch.Tensor:
    """transformers' Gemma 2 eager attention of sequence ``seq``'s query rows over its
    cached context, masked by transformers' mask functions."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    meta = batch.meta
    q0, q1 = int(meta.query_start_loc[seq]), int(meta.query_start_loc[seq + 1])
    ctx = int(meta.seq_lens[seq])
    k = gather_context(batch.key_cache, meta.block_tables[seq], ctx).unsqueeze(0)
    v = gather_context(batch.value_cache, meta.block_tables[seq], ctx).unsqueeze(0)
    q = batch.query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q_idx = torch.arange(ctx - (q1 - q0), ctx).view(-1, 1)
    kv_idx = torch.arange(ctx).view(1, -1)
    allowed = fn(0, 0, q_idx, kv_idx)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1],
                                   training=False, head_dim=q.shape[-1])
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=scale, softcap=cap)
    return out[0]  # [Lq, Hq, D]


@pytest.mark.parametrize(
    ("window", "cap"),
    [(None, None), (None, 1.5), (6, None), (6, 1.5), (1, 3.0)],
    ids=["plain", "soft-cap", "window", "window-soft-cap", "window-of-one"],
)
def test_reference_matches_transformers_gemma2_attention(window: int | None,
                                                         cap: float | None) -> None:
    # a fresh prompt, a chunk over a cached prefix, a decode-like single row after them
    batch = make_batch([9, 5, 1], [9, 23, 31], 8, 2, 16, 8, torch.float32,
                       sliding_window=window, logits_soft_cap=cap, seed=21)
    scale = 24**-0.5 * 3  # not head_dim ** -0.5, and large enough for the cap to bite
    ref = TorchAttentionBackend().forward(batch.query, batch.key_cache, batch.value_cache,
                                          batch.meta, scale)
    starts = batch.meta.query_start_loc.tolist()
    for seq in range(batch.meta.num_seqs):
        expected = _transformers_attention(batch, seq, scale, window, cap)
        got = ref[starts[seq] : starts[seq + 1]]
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), seq


def test_the_soft_cap_changes_the_attention_it_is_tested_with() -> None:
    capped = make_batch([9, 5], [9, 23], 8, 2, 16, 8, torch.float32, logits_soft_cap=1.5,
                        seed=21)
    plain = make_batch([9, 5], [9, 23], 8, 2, 16, 8, torch.float32, seed=21)
    ref = TorchAttentionBackend()
    a = ref.forward(capped.query, capped.key_cache, capped.value_cache, capped.meta, 0.6)
    b = ref.forward(plain.query, plain.key_cache, plain.value_cache, plain.meta, 0.6)
    assert float((a - b).abs().max()) > 0.1
