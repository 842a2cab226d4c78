"""Paged MoE decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) vs transformers: full-sequence logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.torch_ref import TorchAttentionBackend
from qworker.errors import ModelLoadError
from qworker.models.loader import load_model
from qworker.models.moe import SparseMoeBlock
from qworker.models.moe_exec import ExpertPath, force_path, grouped_mm_available
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import hf_reference, paged_vs_hf_max_diff, random_prompts

ATOL = 1e-4
PROMPT_LENGTHS = [5, 17, 33]
FIXTURES = ["tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir"]


def _max_diff(model_dir: Path, **kwargs: Any) -> float:
    loaded = load_model(model_dir, torch.float32, "cpu")
    prompts = random_prompts(PROMPT_LENGTHS, loaded.spec.vocab_size)
    return paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts, **kwargs)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_paged_logits_match_transformers_for_each_moe_architecture(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    assert _max_diff(request.getfixturevalue(fixture), backend=CpuAttentionBackend()) < ATOL


def test_both_expert_paths_and_the_torch_backend_match(tiny_qwen2_moe_dir: Path) -> None:
    paths = [ExpertPath.LOOP]
    if grouped_mm_available(torch.device("cpu"), torch.float32):
        paths.append(ExpertPath.GROUPED_MM)
    for path in paths:
        with force_path(path):
            assert _max_diff(tiny_qwen2_moe_dir, backend=TorchAttentionBackend(),
                             prefill_chunk=6) < ATOL


@pytest.mark.parametrize(
    ("arch", "overrides", "sparse_layers"),
    [
        pytest.param("mixtral", {"num_local_experts": 16, "num_experts_per_tok": 4},
                     [0, 1], id="mixtral-16x-top4"),
        pytest.param("mixtral", {"sliding_window": 8}, [0, 1], id="mixtral-window"),
        pytest.param("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2,
                                   "norm_topk_prob": True, "qkv_bias": False},
                     [0, 1], id="qwen2-moe-8x-top2-norm-nobias"),
        pytest.param("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2},
                     [1, 3], id="qwen3-moe-sparse-step-2"),
        pytest.param("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0, 2],
                                   "norm_topk_prob": False}, [1], id="qwen3-moe-mlp-only"),
        pytest.param("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]},
                     [0, 2], id="qwen2-moe-mlp-only"),
        # transformers writes an empty shared expert (and its gate) for width 0
        pytest.param("qwen2_moe", {"shared_expert_intermediate_size": 0, "num_experts": 6,
                                   "num_experts_per_tok": 2}, [0, 1],
                     id="qwen2-moe-no-shared-expert"),
    ],
)
def test_moe_config_variants_match_transformers(
    arch: str, overrides: dict[str, Any], sparse_layers: list[int], tmp_path: Path
) -> None:
    model_dir = make_tiny_model_dir(arch, tmp_path / "m", seed=21, **overrides)
    loaded = load_model(model_dir, torch.float32, "cpu")
    layers = loaded.model.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)] \
        == sparse_layers
    prompts = random_prompts(PROMPT_LENGTHS, loaded.spec.vocab_size)
    window = overrides.get("sliding_window")
    diff = paged_vs_hf_max_diff(loaded.model, hf_reference(model_dir), prompts,
                                sliding_window=window, prefill_chunk=7 if window else None,
                                backend=CpuAttentionBackend())
    assert diff < ATOL


def test_fused_expert_tensors_load_like_per_expert_ones(tiny_mixtral_dir: Path,
                                                        tmp_path: Path) -> None:
    """transformers 5 holds experts fused (``mlp.experts.gate_up_proj``): a checkpoint
    written from that state dict loads to the same model."""
    import shutil

    from safetensors.torch import save_file

    hf = hf_reference(tiny_mixtral_dir)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_mixtral_dir / name, fused / name)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    a = load_model(tiny_mixtral_dir, torch.float32, "cpu").model.state_dict()
    b = load_model(fused, torch.float32, "cpu").model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_a_missing_expert_is_named(tiny_qwen3_moe_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_moe_dir, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(broken, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param({"num_experts_per_tok": 32}, "num_experts_per_tok=32 exceeds the 16",
                     id="top-k-over-experts"),
        pytest.param({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer",
                     id="sparse-step-0"),
        pytest.param({"moe_intermediate_size": 0}, "moe_intermediate_size must be",
                     id="zero-width-experts"),
    ],
)
def test_moe_configs_that_cannot_work_are_clear_errors(
    overrides: dict[str, Any], message: str, tmp_path: Path
) -> None:
    import json

    model_dir = make_tiny_model_dir("qwen3_moe", tmp_path / "m", num_hidden_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(overrides)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(model_dir, torch.float32, "cpu")


@pytest.mark.parametrize("architecture", ["DeepseekV3ForCausalLM", "OlmoeForCausalLM",
                                          "GptOssForCausalLM", "PhimoeForCausalLM"])
def test_moe_architectures_we_do_not_serve_are_refused_by_name(
    architecture: str, tmp_path: Path
) -> None:
    import json

    model_dir = make_tiny_model_dir("qwen3_moe", tmp_path / "m", num_hidden_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = [architecture]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"unsupported model architecture {architecture}"):
        load_model(model_dir, torch.float32, "cpu")
