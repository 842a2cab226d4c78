"""Greedy choice under grammar bitmasks (token_mask.c) against torch's where + argmax."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qworker import cpu_kernels
from qworker.engine.structured.bitmask import (
    apply_token_bitmask,
    masked_argmax_cpu,
    unpack_allowed,
)


def _reference(logits: torch.Tensor, rows: np.ndarray, index: np.ndarray,
               words: torch.Tensor) -> torch.Tensor:
    allowed = unpack_allowed(words, logits.shape[1], torch.device("cpu"))[index]
    return apply_token_bitmask(logits, rows, allowed).argmax(dim=-1)


@pytest.mark.parametrize("vocab", [1, 31, 32, 75, 1000])
def test_masked_argmax_matches_where_then_argmax(kernel_cache: Path, vocab: int) -> None:
    kernels = cpu_kernels.load(kernel_cache)
    if kernels is None:
        pytest.skip("no C compiler here (the sampler keeps the torch form)")
    rng = np.random.default_rng(vocab)
    nwords = -(-vocab // 32)
    num_rows = 9
    # masks of every kind: sparse (a grammar outside strings), dense, empty, full, EOS-only
    density = [0.002, 0.5, 0.0, 1.0, 0.05, 0.9, 0.3]
    bits = np.stack([rng.random(nwords * 32) < d for d in density])
    bits[6] = False
    bits[6, vocab - 1] = True
    words = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())
    wide = torch.from_numpy(rng.standard_normal((num_rows, 2 * vocab)).astype(np.float32))
    logits = wide[:, ::2].contiguous()
    logits[0, : min(vocab, 4)] = 7.0  # ties: the first allowed one wins
    logits[1, vocab // 2] = float("inf")
    logits[4] = float("-inf")  # nothing above -inf: index 0, as torch
    if vocab > 3:
        logits[5, 3] = float("nan")  # NaN propagates, as torch's argmax
    rows = np.array([0, 1, 2, 3, 4, 5, 8])  # rows 6 and 7 unconstrained
    index = np.array([0, 1, 2, 3, 4, 5, 6])
    got = masked_argmax_cpu(kernels, logits, rows, index, words)
    assert torch.equal(got, _reference(logits, rows, index, words))
    # strided logits, mask rows shared and out of order
    index2 = np.array([6, 6, 1, 0, 3, 2, 5])
    got2 = masked_argmax_cpu(kernels, wide[:, :vocab], rows, index2, words)
    assert torch.equal(got2, _reference(wide[:, :vocab].contiguous(), rows, index2, words))


def test_tokens_past_the_mask_are_never_chosen(kernel_cache: Path) -> None:
    kernels = cpu_kernels.load(kernel_cache)
    if kernels is None:
        pytest.skip("no C compiler here (the sampler keeps the torch form)")
    logits = torch.zeros(2, 100)
    logits[:, 80] = 5.0  # the best logit lies past a 64-token mask
    logits[:, 3] = 1.0
    words = torch.zeros(1, 2, dtype=torch.int32)
    words[0, 0] = 1 << 3
    got = masked_argmax_cpu(kernels, logits, np.array([0]), np.array([0]), words)
    assert got.tolist() == [3, 80]  # the masked row stays inside its mask; row 1 is free
