"""FP8 checkpoints load and match their references; online FP8; unsupported methods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from qworker.errors import ModelLoadError
from qworker.models.loader import load_model
from qworker.models.quant.fp8_linear import ActQuantFusedLinear, ActQuantLinear
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged import hf_reference, paged_vs_hf_max_diff, random_prompts
from tests.models.quant.checkpoints import write_block_fp8, write_compressed_tensors

ATOL = 1e-4
LENGTHS = [5, 17, 33]


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("fp8_dense"), seed=41,
                               attention_bias=True)


@pytest.fixture(scope="module")
def ct_dynamic_dir(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_compressed_tensors(dense_dir, tmp_path_factory.mktemp("ct_dyn"), "FP8_DYNAMIC")


@pytest.fixture(scope="module")
def ct_static_dir(dense_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_compressed_tensors(dense_dir, tmp_path_factory.mktemp("ct_static"), "FP8",
                                    calibration=random_prompts(LENGTHS, 512, seed=9))


def _diff(model_dir: Path, ref_dir: Path | None = None, **load: Any) -> float:
    loaded = load_model(model_dir, torch.float32, "cpu", **load)
    prompts = random_prompts(LENGTHS, loaded.spec.vocab_size)
    return paged_vs_hf_max_diff(loaded.model, hf_reference(ref_dir or model_dir), prompts)


def test_compressed_tensors_dynamic_fp8_matches_transformers(ct_dynamic_dir: Path) -> None:
    config = json.loads((ct_dynamic_dir / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    assert groups["group_0"]["weights"]["strategy"] == "channel"
    loaded = load_model(ct_dynamic_dir, torch.float32, "cpu")
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, ActQuantFusedLinear)
    assert isinstance(layer.mlp.down_proj, ActQuantLinear)
    assert _diff(ct_dynamic_dir) < ATOL
    # The reference quantizes activations too: weights alone do not match it.
    assert _diff(ct_dynamic_dir, quantization="none") > 10 * ATOL


def test_compressed_tensors_static_fp8_matches_transformers(ct_static_dir: Path) -> None:
    config = json.loads((ct_static_dir / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor"
    assert group["input_activations"]["dynamic"] is False
    loaded = load_model(ct_static_dir, torch.float32, "cpu")
    scale = loaded.model.model.layers[1].mlp.down_proj.input_scale
    assert scale is not None and float(scale) > 0
    assert _diff(ct_static_dir) < ATOL


def test_online_fp8_equals_compressed_tensors_own_dynamic_fp8(dense_dir: Path,
                                                              ct_dynamic_dir: Path) -> None:
    """``quantization="fp8"`` on the dense checkpoint quantizes exactly as compressed-
    tensors' FP8_DYNAMIC does (per-channel amax weights, per-token activations)."""
    assert _diff(dense_dir, ct_dynamic_dir, quantization="fp8") < ATOL
    # and it is not the dense model
    assert _diff(dense_dir, dense_dir, quantization="fp8") > 1e-3


def test_phi3_fused_checkpoint_layers_quantize_as_transformers(tmp_path: Path) -> None:
    """Phi-3 ships qkv_proj / gate_up_proj fused under their own names: they are FP8 layers
    like the others (they were left dense, their inputs unquantized), from the checkpoint
    and under online FP8."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    dense = make_tiny_model_dir("phi3", tmp_path / "dense", seed=42, rope_parameters=rope)
    ct = write_compressed_tensors(dense, tmp_path / "ct", "FP8_DYNAMIC")
    layer = load_model(ct, torch.float32, "cpu").model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, ActQuantFusedLinear)
    assert isinstance(layer.mlp.gate_up_proj, ActQuantFusedLinear)
    assert _diff(ct) < ATOL
    assert _diff(dense, ct, quantization="fp8") < ATOL


def test_quantization_none_runs_an_fp8_checkpoint_dequantized(ct_dynamic_dir: Path) -> None:
    loaded = load_model(ct_dynamic_dir, torch.float32, "cpu", quantization="none")
    assert not any(isinstance(m, ActQuantLinear | ActQuantFusedLinear)
                   for m in loaded.model.modules())
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())


@pytest.mark.parametrize(
    ("arch", "block"),
    [pytest.param("llama", (16, 16), id="llama-16x16"),
     pytest.param("llama", (128, 128), id="llama-128x128"),
     pytest.param("qwen3_moe", (16, 16), id="qwen3-moe-experts-16x16")],
)
def test_block_fp8_checkpoint_matches_transformers_fine_grained_fp8(
    arch: str, block: tuple[int, int], tmp_path: Path
) -> None:
    pytest.importorskip("accelerate")  # transformers' FP8 loading needs it
    dense = make_tiny_model_dir(arch, tmp_path / "dense", seed=42)
    fp8 = write_block_fp8(dense, tmp_path / "fp8", block)
    from safetensors import safe_open

    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    if arch == "qwen3_moe":
        assert dtypes["model.layers.0.mlp.experts.3.down_proj.weight"] == "F8_E4M3"
    reference = hf_reference(fp8)
    assert reference.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert _diff(fp8) < ATOL
    assert _diff(fp8, dense) > 1e-4  # the reference really is the quantized model


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq' is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not"),
        ({"quant_method": "mxfp4"}, "'mxfp4' is not supported"),
        ({"quant_method": "something-new"}, "'something-new' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "static"},
         "activation_scheme 'static' is not supported"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                        "weights": {"num_bits": 4, "type": "int",
                                                    "strategy": "group", "group_size": 128}}}},
         "4-bit int weights"),
    ],
)
@pytest.mark.parametrize("mode", ["auto", "fp8", "none"])
def test_unsupported_quantization_methods_are_one_line_errors_naming_them(
    quantization_config: dict[str, Any], message: str, mode: str, tmp_path: Path
) -> None:
    model_dir = make_tiny_model_dir("llama", tmp_path / "m", num_hidden_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(model_dir, torch.float32, "cpu", quantization=mode)
    assert "\n" not in str(info.value)


def test_an_fp8_weight_without_its_scale_is_named(ct_dynamic_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(ct_dynamic_dir, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight is FP8 "
                                             r"but the checkpoint has no .*weight_scale"):
        load_model(broken, torch.float32, "cpu")
