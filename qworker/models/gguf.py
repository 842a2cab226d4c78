"""GGUF checkpoints through transformers' GGUF support (config, dequantized tensors).

transformers already knows how to read a GGUF file's metadata into a config, map its
tensor names to HF names and dequantize (including undoing llama.cpp's Q/K row
permutation); reusing it keeps qworker from carrying a second dequantizer. The
dequantized tensors are materialised together by transformers, so loading a GGUF
briefly costs one full-precision copy of the weights in host memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qworker.errors import ModelLoadError

logger = logging.getLogger(__name__)


def load_gguf_config(gguf: Path) -> Any:
    """The transformers config that the GGUF file's metadata describes."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the GGUF metadata of {gguf}: {exc}") from exc


def load_gguf_tensors(
    gguf: Path, config: Any, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of ``gguf``, dequantized to ``dtype``."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        # An HF skeleton on the meta device only tells transformers the target names.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(
            str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype
        )
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read the tensors of {gguf}: {exc}") from exc
    tensors: dict[str, torch.Tensor] = parsed.get("tensors", {})
    if not tensors:
        raise ModelLoadError(f"{gguf} holds no tensors transformers can map")
    # Pop as we go so each tensor is freed once copied into the model.
    for name in list(tensors):
        yield name, tensors.pop(name)
