"""Paged Llama-family forward vs transformers: full-sequence logits in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.torch_ref import TorchAttentionBackend
from qworker.errors import ModelLoadError
from qworker.models.loader import load_model
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import hf_reference, paged_vs_hf_max_diff, random_prompts

ATOL = 1e-4
PROMPT_LENGTHS = [5, 17, 33]


def _max_diff(model_dir: Path, **kwargs: Any) -> float:
    loaded = load_model(model_dir, torch.float32, "cpu")
    prompts = random_prompts(PROMPT_LENGTHS, loaded.spec.vocab_size)
    return paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts, **kwargs)


BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(
    "fixture",
    ["tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"],
)
def test_paged_logits_match_transformers_for_each_architecture(
    fixture: str, backend: str, request: pytest.FixtureRequest
) -> None:
    assert _max_diff(request.getfixturevalue(fixture), backend=BACKENDS[backend]()) < ATOL


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_chunked_prefill_over_block_boundaries_matches_transformers(
    tiny_llama_dir: Path, backend: str
) -> None:
    assert _max_diff(tiny_llama_dir, prefill_chunk=6, block_size=8,
                     backend=BACKENDS[backend]()) < ATOL


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        pytest.param(
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            id="llama3-rope",
        ),
        pytest.param(
            "llama",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
            id="linear-rope",
        ),
        pytest.param(
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            },
            id="yarn-rope",
        ),
        pytest.param("llama", {"head_dim": 32}, id="head-dim-not-hidden-over-heads"),
        pytest.param("llama", {"num_key_value_heads": 1}, id="mqa"),
        pytest.param("llama", {"num_key_value_heads": 4}, id="mha"),
        pytest.param("llama", {"tie_word_embeddings": True}, id="tied-embeddings"),
        pytest.param(
            "llama", {"attention_bias": True, "mlp_bias": True}, id="attention-and-mlp-bias"
        ),
        pytest.param("qwen2", {"tie_word_embeddings": False}, id="qwen2-untied"),
        pytest.param("qwen3", {"attention_bias": True}, id="qwen3-bias"),
    ],
)
def test_config_variants_match_transformers(
    arch: str, overrides: dict[str, Any], tmp_path: Path
) -> None:
    model_dir = make_tiny_model_dir(arch, tmp_path / "m", seed=7, **overrides)
    assert _max_diff(model_dir) < ATOL


def test_legacy_rope_scaling_config_key_is_honoured(tmp_path: Path) -> None:
    import json

    model_dir = make_tiny_model_dir("llama", tmp_path / "m", seed=8)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 1000.0
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = hf_reference(model_dir)
    assert reference.config.rope_parameters["rope_type"] == "linear"
    assert _max_diff(model_dir) < ATOL


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mistral_sliding_window_limits_attention_like_transformers(
    tmp_path: Path, backend: str
) -> None:
    model_dir = make_tiny_model_dir("mistral", tmp_path / "m", seed=9, sliding_window=8)
    loaded = load_model(model_dir, torch.float32, "cpu")
    assert loaded.spec.sliding_window == 8
    prompts = random_prompts(PROMPT_LENGTHS, loaded.spec.vocab_size)
    diff = paged_vs_hf_max_diff(
        loaded.model, hf_reference(model_dir), prompts, sliding_window=8, prefill_chunk=7,
        backend=BACKENDS[backend](),
    )
    assert diff < ATOL


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_qwen2_windowed_layers_override_the_step_window(tmp_path: Path, backend: str) -> None:
    model_dir = make_tiny_model_dir(
        "qwen2",
        tmp_path / "m",
        seed=10,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    loaded = load_model(model_dir, torch.float32, "cpu")
    assert loaded.spec.sliding_window is None  # mixed: layer 0 full, layer 1 windowed
    prompts = random_prompts(PROMPT_LENGTHS, loaded.spec.vocab_size)
    diff = paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts,
                                backend=BACKENDS[backend]())
    assert diff < ATOL


def test_dynamic_rope_scaling_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(
        "llama",
        tmp_path / "m",
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )
    with pytest.raises(ModelLoadError, match="dynamic"):
        load_model(model_dir, torch.float32, "cpu")


def test_bfloat16_load_runs_and_stays_close_to_fp32(tiny_llama_dir: Path) -> None:
    fp32 = load_model(tiny_llama_dir, torch.float32, "cpu")
    bf16 = load_model(tiny_llama_dir, torch.bfloat16, "cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.spec.dtype == torch.bfloat16
    from tests.models.paged import PagedRunner

    prompt = random_prompts([20], fp32.spec.vocab_size)[0]
    ref = PagedRunner(fp32.model).step({0: prompt})[0]
    out = PagedRunner(bf16.model).step({0: prompt})[0]
    assert out.dtype == torch.float32
    assert float((out - ref).abs().max()) < 0.1 * float(ref.abs().max())
