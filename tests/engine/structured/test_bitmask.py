"""Bitmask unpacking and application against a plain per-token reference."""

from __future__ import annotations

import numpy as np
import torch

from qworker.engine.structured.bitmask import apply_token_bitmask, unpack_allowed


def _reference(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.array([[(int(row[t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
                     for row in words], dtype=bool)


def test_unpacked_bits_and_masked_rows_match_a_per_token_reference() -> None:
    rng = np.random.default_rng(0)
    vocab = 75  # not a multiple of 32: the last word is partly padding
    words = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    allowed = unpack_allowed(torch.from_numpy(words), vocab, torch.device("cpu"))
    assert allowed.shape == (3, vocab) and allowed.dtype == torch.bool
    assert (allowed.numpy() == _reference(words, vocab)).all()
    logits = torch.randn(5, vocab)
    before = logits.clone()
    rows = np.array([4, 0, 2])
    masked = apply_token_bitmask(logits, rows, allowed)
    assert torch.equal(logits, before)  # the caller's logits are left alone
    for j, r in enumerate(rows):
        expect = torch.where(allowed[j], before[r], torch.tensor(float("-inf")))
        assert torch.equal(masked[r], expect)
    assert torch.equal(masked[1], before[1]) and torch.equal(masked[3], before[3])
    whole = apply_token_bitmask(before[:3], np.arange(3), allowed)  # every row, in order
    assert torch.equal(whole.isinf(), ~allowed)


def test_the_cpu_form_is_bit_identical_to_where_on_special_values_and_strided_rows() -> None:
    rng = np.random.default_rng(1)
    vocab = 200
    wide = torch.from_numpy(rng.standard_normal((4, 2 * vocab)).astype(np.float32))
    logits = wide[:, ::2]  # not contiguous
    logits[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 3e38])
    allowed = torch.from_numpy(rng.random((4, vocab)) < 0.3)
    allowed[0, :6] = torch.tensor([True, True, True, True, False, False])
    masked = apply_token_bitmask(logits, np.arange(4), allowed)
    expect = torch.where(allowed, logits, float("-inf"))
    assert masked.dtype == torch.float32
    assert torch.equal(masked.view(torch.int32), expect.contiguous().view(torch.int32))
