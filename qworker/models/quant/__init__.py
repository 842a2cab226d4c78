"""FP8 checkpoints and on-load FP8 quantization (docs/quantization.md).

``plan_quantization`` reads a checkpoint's ``quantization_config`` under the
``quantization`` knob and returns the ``QuantizedLoad`` that prepares the model and
adapts its weight stream, or None for an unquantized load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qworker.models.quant.prepare import QuantizedLoad, fp8_weight_names, weight_bytes
from qworker.models.quant.scheme import (
    QUANTIZATION_MODES,
    ActQuant,
    Fp8Scheme,
    WeightScales,
    resolve_scheme,
)

__all__ = [
    "QUANTIZATION_MODES",
    "ActQuant",
    "Fp8Scheme",
    "QuantizedLoad",
    "WeightScales",
    "plan_quantization",
    "weight_bytes",
]


def plan_quantization(raw_config: dict[str, Any], mode: str, dtype: torch.dtype,
                      device: torch.device, files: list[Path] | None = None
                      ) -> QuantizedLoad | None:
    """The FP8 plan for a checkpoint (``files``: its safetensors; None for GGUF or dummy
    weights) under ``mode`` (``auto`` | ``fp8`` | ``none``), or None when nothing is
    quantized. Raises ``ModelLoadError`` for a quantization method qworker cannot load."""
    qc = raw_config.get("quantization_config")
    checkpoint = resolve_scheme(qc, "auto")
    scheme = resolve_scheme(qc, mode)
    if checkpoint is None and scheme is None:
        return None
    names = fp8_weight_names(files) if files else set()
    if scheme is None:  # "none" on an FP8 checkpoint: dequantize it all
        assert checkpoint is not None
        return QuantizedLoad(checkpoint, device, dtype, names, dequantize_only=True)
    if files is None and not scheme.online:
        # dummy weights of an FP8 model's shape: make them FP8 on load, the checkpoint's
        # scheme's activations
        scheme = Fp8Scheme("online", WeightScales.CHANNEL, ActQuant.DYNAMIC_TOKEN)
    return QuantizedLoad(scheme, device, dtype, names)
