"""Paged OPT forward vs transformers: full-sequence logits in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.torch_ref import TorchAttentionBackend
from qworker.models.loader import load_model
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import hf_reference, paged_vs_hf_max_diff, random_prompts

ATOL = 1e-4


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
def test_opt_paged_logits_match_transformers(tiny_opt_dir: Path, backend: type) -> None:
    loaded = load_model(tiny_opt_dir, torch.float32, "cpu")
    assert loaded.spec.architecture == "OPTForCausalLM"
    prompts = random_prompts([4, 19, 30], loaded.spec.vocab_size)
    diff = paged_vs_hf_max_diff(loaded.model, hf_reference(tiny_opt_dir), prompts, prefill_chunk=9,
                                backend=backend())
    assert diff < ATOL


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"do_layer_norm_before": False}, id="post-layernorm"),
        pytest.param({"word_embed_proj_dim": 32}, id="embedding-projection"),
        pytest.param({"tie_word_embeddings": False}, id="untied-head"),
    ],
)
def test_opt_variants_match_transformers(overrides: dict[str, Any], tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir("opt", tmp_path / "m", seed=11, **overrides)
    loaded = load_model(model_dir, torch.float32, "cpu")
    prompts = random_prompts([6, 21], loaded.spec.vocab_size)
    assert paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts) < ATOL
