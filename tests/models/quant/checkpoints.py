"""FP8 checkpoints for tests, written from tiny random models.

``write_compressed_tensors``: the ``compressed-tensors`` package's own quantization and
compression of a transformers model (weights scaled from their amax, static input scales
calibrated on sample prompts), saved with ``save_pretrained``; transformers loads it back
as the reference. ``write_block_fp8``: the layout Qwen's "-FP8" checkpoints ship
(``quant_method: fp8``, ``weight_block_size``, FP8 ``weight`` + fp32 ``weight_scale_inv``
per linear layer and per expert; embeddings, norms, routers and the LM head unquantized).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

_BLOCK_SKIP = ("embed_tokens", "lm_head", "norm", ".mlp.gate.weight", "shared_expert_gate")


def write_compressed_tensors(src: Path, dst: Path, preset: str,
                             calibration: list[list[int]] | None = None) -> Path:
    """``src`` (an fp32 HF dir) quantized with compressed-tensors' ``preset``
    (``FP8_DYNAMIC``, ``FP8``, ...), ``lm_head`` ignored, saved compressed into ``dst``."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.eval()
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset,
                                                                                ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "quantization_scheme")}
    amax: dict[str, float] = {}
    hooks = []
    for name, module in quantized.items():
        scheme = module.quantization_scheme
        w = module.weight.data
        if scheme.weights.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, _ = calculate_qparams(lo, hi, scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        acts = scheme.input_activations
        if acts is not None and not acts.dynamic:
            def hook(_: Any, inputs: tuple[torch.Tensor, ...], name: str = name) -> None:
                amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))

            hooks.append(module.register_forward_pre_hook(hook))
    if hooks:
        for module in quantized.values():
            module.quantization_enabled = False
        with torch.no_grad():
            for prompt in calibration or [[5, 6, 7, 8, 9]]:
                model(torch.tensor([prompt]))
        for handle in hooks:
            handle.remove()
        for name, module in quantized.items():
            module.quantization_enabled = True
            a = torch.tensor([amax[name]])
            scale, _ = calculate_qparams(-a, a, module.quantization_scheme.input_activations)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(dst))
    compressor.update_config(str(dst))
    shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    return dst


def block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w8, scale_inv grid)``: one scale per (possibly partial) block, amax / 448."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    scales = torch.empty(gn, gk)
    w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(gn):
        for j in range(gk):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            s = max(float(tile.abs().max()) / 448.0, 1e-12)
            scales[i, j] = s
            w8[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / s).clamp(-448, 448).to(
                torch.float8_e4m3fn)
    return w8, scales


def write_block_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """``src`` (an HF dir) with its linear and expert weights block-quantized, Qwen's
    "-FP8" layout, into ``dst``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, dst / item.name)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if tensor.dim() == 2 and name.endswith(".weight") and not any(
                    s in name for s in _BLOCK_SKIP):
                w8, scales = block_quantize(tensor, block)
                out[name] = w8
                out[name.removesuffix(".weight") + ".weight_scale_inv"] = scales
            else:
                out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
