"""Packed attention: every input attends only to itself, whatever group it lands in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.models.packed_attention import PackedAttention, PackedBatch


def test_inputs_of_very_different_lengths_are_split_into_a_few_groups() -> None:
    batch = PackedBatch.build([1, 4, 18, 20, 40, 90, 100], torch.device("cpu"))
    spans = [(g.start, g.end, g.num_seqs, g.max_len) for g in batch.groups]
    assert spans == [(0, 5, 2, 4), (5, 43, 2, 20), (43, 83, 1, 40), (83, 273, 2, 100)]
    assert batch.positions[5:8].tolist() == [0, 1, 2] and batch.num_tokens == 273
    assert len(PackedBatch.build([9, 24, 12, 20], torch.device("cpu")).groups) == 1


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, 6)])
def test_packed_attention_equals_each_input_alone(causal: bool, window: int | None) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    lengths = [7, 1, 40, 3, 90, 22]
    attn = PackedAttention(heads, kv_heads, dim, dim**-0.5, causal=causal,
                           sliding_window=window)
    batch = PackedBatch.build(lengths, torch.device("cpu"))
    assert len(batch.groups) > 1
    total = sum(lengths)
    q = torch.randn(total, heads * dim)
    k = torch.randn(total, kv_heads * dim)
    v = torch.randn(total, kv_heads * dim)
    got = attn(q, k, v, batch)
    start = 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].view(n, -1, dim).transpose(0, 1).unsqueeze(0)
                      for t in (q, k, v))
        ks, vs = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (ks, vs))
        mask = None
        if causal:
            pos = torch.arange(n)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < (window or n + 1))
        want = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=dim**-0.5)
        torch.testing.assert_close(got[start:start + n],
                                   want[0].transpose(0, 1).reshape(n, heads * dim),
                                   atol=1e-5, rtol=0)
        start += n
