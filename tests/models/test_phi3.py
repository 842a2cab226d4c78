"""Phi-3 / Phi-4 over the paged KV cache vs transformers' Phi-3, fp32 logits: checkpoint-fused
q/k/v and gate/up, longrope with its short and long factors, partial rotary, windows.

transformers picks longrope's factors per forward by the largest position in it; the
engine picks once by its context length (``set_max_model_len``). Each test below runs
where the two agree: every sequence within the original length with a short context,
or every forward past it with a long one (the reference then runs each full sequence in
one forward, past the original length). ``tests/engine/test_llm.py`` covers a sequence
that crosses the threshold while it generates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.models.loader import load_model
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import hf_reference, paged_vs_hf_max_diff, random_prompts

ATOL = 1e-4
ORIGINAL = 64  # original_max_position_embeddings of the tiny Phi-3


def test_checkpoint_fused_tensors_load_into_the_fused_layers(tiny_phi3_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_phi3_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("model.layers.0.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    model = load_model(tiny_phi3_dir, torch.float32, "cpu").model
    layers = model.model.layers
    assert torch.equal(layers[0].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layers[1].mlp.gate_up_proj.weight, gate_up)
    assert layers[0].self_attn.qkv_proj.split_sizes == [64, 32, 32]


def test_short_factors_within_the_original_length(tiny_phi3_dir: Path) -> None:
    loaded = load_model(tiny_phi3_dir, torch.float32, "cpu")
    loaded.model.set_max_model_len(ORIGINAL)
    prompts = random_prompts([5, 17, 33], 512)  # + 4 decodes: all within 64 positions
    diff = paged_vs_hf_max_diff(loaded.model, hf_reference(tiny_phi3_dir), prompts,
                                prefill_chunk=6, backend=CpuAttentionBackend())
    assert diff < ATOL


@pytest.mark.parametrize("chunk", [None, 30], ids=["whole-prompts", "chunks-across-64"])
def test_long_factors_past_the_original_length(tiny_phi3_dir: Path, chunk: int | None) -> None:
    loaded = load_model(tiny_phi3_dir, torch.float32, "cpu")
    loaded.model.set_max_model_len(256)
    prompts = random_prompts([70, 90, 66], 512, seed=4)
    diff = paged_vs_hf_max_diff(loaded.model, hf_reference(tiny_phi3_dir), prompts,
                                prefill_chunk=chunk)
    assert diff < ATOL


def test_the_two_factor_sets_and_the_attention_factor_differ_as_transformers_has_them(
    tiny_phi3_dir: Path,
) -> None:
    import math

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = load_model(tiny_phi3_dir, torch.float32, "cpu").model
    config = model.config
    # default context: max_position_embeddings (256) > 64, so long factors (vLLM's default)
    long_cos = model.model.rotary.tables(torch.empty(0))[0].clone()
    model.set_max_model_len(ORIGINAL)
    short_cos = model.model.rotary.tables(torch.empty(0))[0]
    assert short_cos.shape == long_cos.shape == (256, 4)  # rotary dim 8 of head 16
    factor = math.sqrt(1 + math.log(256 / ORIGINAL) / math.log(ORIGINAL))
    assert torch.allclose(short_cos[0], torch.full((4,), factor))  # cos(0) * attention factor
    short_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=ORIGINAL + 1)
    assert not torch.equal(short_inv, long_inv)
    pos = torch.arange(256).float()
    assert torch.equal(short_cos, (pos[:, None] * short_inv[None]).cos() * factor)
    assert torch.equal(long_cos, (pos[:, None] * long_inv[None]).cos() * factor)


def _config_variant(tmp_path: Path, edit: Any, seed: int = 31) -> Path:
    model_dir = make_tiny_model_dir("phi3", tmp_path / "m", seed=seed)
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize("name", ["longrope", "su"])
def test_older_rope_scaling_configs_are_longrope(tmp_path: Path, name: str) -> None:
    # Phi-3-mini-128k as first released: rope_scaling {"type": "su", ...}; later "longrope".
    # transformers cannot parse "su" (it renames it, then fails to validate it), so the
    # reference reads the same config named "longrope".
    def older(config: dict[str, Any], kind: str = name) -> None:
        params = config.pop("rope_parameters")
        config["rope_theta"] = params["rope_theta"]
        config["partial_rotary_factor"] = params["partial_rotary_factor"]
        config["rope_scaling"] = {"type": kind, "short_factor": params["short_factor"],
                                  "long_factor": params["long_factor"]}

    model_dir = _config_variant(tmp_path, older)
    loaded = load_model(model_dir, torch.float32, "cpu")
    assert loaded.config.rope_parameters["rope_type"] == "longrope"
    if name == "su":
        _config_variant(tmp_path, lambda c: older(c, "longrope"))  # same weights (seed)
    reference = hf_reference(model_dir)
    assert reference.config.rope_parameters["rope_type"] == "longrope"
    loaded.model.set_max_model_len(256)
    prompts = random_prompts([80, 70], 512, seed=5)
    assert paged_vs_hf_max_diff(loaded.model, reference, prompts, prefill_chunk=40) < ATOL


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
                     id="phi4-full-rotary-default-rope"),
        pytest.param({"sliding_window": 10}, id="sliding-window-every-layer"),
        pytest.param({"num_key_value_heads": 4, "tie_word_embeddings": True}, id="mha-tied"),
    ],
)
def test_config_variants_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    model_dir = make_tiny_model_dir("phi3", tmp_path / "m", seed=32, **overrides)
    loaded = load_model(model_dir, torch.float32, "cpu")
    loaded.model.set_max_model_len(ORIGINAL)
    prompts = random_prompts([5, 17, 33], 512)
    assert paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts,
                                prefill_chunk=7) < ATOL
