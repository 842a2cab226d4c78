"""The attention layer's per-layer metadata: one derived view per (window, soft-cap) and step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qworker.attention.paged_attention import (
    PagedAttention,
    current_metadata,
    describe_layers,
    forward_context,
)
from tests.attention.cases import make_batch


def test_each_window_and_cap_pair_gets_its_own_metadata_once_per_step() -> None:
    meta = make_batch([1, 4], [9, 4], 4, 2, 16, 8, torch.float32).meta
    with forward_context(meta):
        plain = current_metadata(None, None)
        assert plain is meta  # nothing to derive
        capped = current_metadata(8, 50.0)
        assert (capped.sliding_window, capped.logits_soft_cap) == (8, 50.0)
        assert capped.slot_mapping is meta.slot_mapping  # tensors shared, not copied
        assert current_metadata(8, 50.0) is capped
        assert current_metadata(8, None) is not capped
        assert current_metadata(None, 50.0).sliding_window is None
    with pytest.raises(RuntimeError, match="forward_context"):
        current_metadata(8, 50.0)


def test_fixed_decode_plans_follow_the_window_whatever_the_cap() -> None:
    meta = make_batch([1, 1], [9, 4], 4, 2, 16, 8, torch.float32).meta
    plans = {None: "plan-full", 8: "plan-window-8"}
    with forward_context(meta, plans):
        assert current_metadata(8, 30.0).decode_plan == "plan-window-8"
        assert current_metadata(8, None).decode_plan == "plan-window-8"
        assert current_metadata(None, 30.0).decode_plan == "plan-full"


def test_a_non_positive_soft_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="logits_soft_cap"):
        PagedAttention(4, 2, 16, 0.25, 0, logits_soft_cap=0.0)


def test_layers_are_described_by_window_and_cap() -> None:
    model = nn.ModuleList([PagedAttention(4, 2, 16, 0.25, i, 8 if i % 2 == 0 else None, 50.0)
                           for i in range(4)])
    assert describe_layers(model) == "4 layers: 2 window 8 soft-cap 50, 2 full soft-cap 50"
