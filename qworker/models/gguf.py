"""GGUF checkpoints through transformers' GGUF support (config, dequantized tensors).

transformers already knows how to read a GGUF file's metadata into a config, map its
tensor names to HF names and dequantize (including undoing llama.cpp's Q/K row
permutation); reusing it keeps qworker from carrying a second dequantizer. The
metadata (with its large tokenizer arrays) is parsed once, and tensors are
dequantized and handed over one at a time, so loading never holds a second
full-precision copy of the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qworker.errors import ModelLoadError

logger = logging.getLogger(__name__)


def load_gguf_config(gguf: Path) -> tuple[Any, dict[str, Any]]:
    """The transformers config the GGUF metadata describes, and the raw config dict.

    The raw dict is what transformers' tensor processors expect (pass it on to
    ``load_gguf_tensors``).
    """
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        raw = dict(load_gguf_checkpoint(str(gguf), return_tensors=False)["config"])
        fields = {k: v for k, v in raw.items() if k != "model_type"}
        config = AutoConfig.for_model(raw["model_type"], **fields)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the GGUF metadata of {gguf}: {exc}") from exc
    return config, raw


def load_gguf_tensors(
    gguf: Path, config: Any, raw_config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of ``gguf``, dequantized to ``dtype``."""
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    try:
        reader = GGUFReader(str(gguf))
        architecture = read_field(reader, "general.architecture")[0]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=raw_config)
        # An HF skeleton on the meta device only tells transformers the target names.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        mapping = get_gguf_hf_weights_map(skeleton, processor)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the tensors of {gguf}: {exc}") from exc
    scratch: dict[str, Any] = {"config": raw_config, "tensors": {}}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=mapping,
            parsed_parameters=scratch,
        )
        if result.name not in mapping:
            continue
        yield mapping[result.name], torch.from_numpy(np.copy(result.weights)).to(dtype)
