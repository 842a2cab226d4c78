"""GGUF checkpoints through transformers' GGUF support (config, dequantized tensors).

transformers already knows how to read a GGUF file's metadata into a config, map its
tensor names to HF names and dequantize (including undoing llama.cpp's Q/K row
permutation); reusing it keeps qworker from carrying a second dequantizer. Tensors
are dequantized and handed over one at a time, so loading never holds a second
full-precision copy of the weights.

Two readers: where transformers ships its struct-based GGUF header reader
(``transformers.integrations.gguf.reader``, ~100x faster on a 49k-token vocabulary
than ``gguf.GGUFReader``) and the architecture is a plain decoder, metadata and tensor
table come from it; otherwise everything goes through the long-standing
``load_gguf_checkpoint`` / ``GGUFReader`` path. Both feed the same ``gguf.dequantize``
and transformers tensor processors, so they yield identical tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qworker.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp architecture names whose config the fast path can rebuild by plain renames.
_FAST_ARCHS = ("llama", "qwen2", "qwen3")
_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30


def _fast_reader() -> Any | None:
    try:
        from transformers.integrations.gguf import reader
    except ImportError:
        return None
    try:
        from transformers.integrations.gguf import dequant
    except ImportError:
        return None
    if not hasattr(dequant, "dequantize"):
        return None
    needed = ("read_gguf_metadata", "GgufHeader", "load_gguf_state_dict")
    return reader if all(hasattr(reader, n) for n in needed) else None


def load_gguf_config(gguf: Path, fast: bool = True) -> tuple[Any, dict[str, Any]]:
    """The transformers config the GGUF metadata describes, and the raw config dict.

    The raw dict is what transformers' tensor processors expect (pass it on to
    ``load_gguf_tensors``). ``fast=False`` forces the legacy metadata parser.
    """
    from transformers import AutoConfig

    try:
        raw = _fast_config(gguf) if fast else None
        if raw is None:
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            raw = dict(load_gguf_checkpoint(str(gguf), return_tensors=False)["config"])
        fields = {k: v for k, v in raw.items() if k != "model_type"}
        config = AutoConfig.for_model(raw["model_type"], **fields)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read the GGUF metadata of {gguf}: {exc}") from exc
    return config, raw


def _fast_config(gguf: Path) -> dict[str, Any] | None:
    """The legacy parser's config dict rebuilt from the fast reader (None: not possible)."""
    reader = _fast_reader()
    if reader is None:
        return None
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    metadata, tensor_names = reader.read_gguf_metadata(str(gguf))
    arch = metadata["general.architecture"]
    name = str(metadata.get("general.name", "")).lower()
    if arch not in _FAST_ARCHS or "mistral" in name:
        return None
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    raw: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        target = renames.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        raw[target] = value
    if "vocab_size" not in raw and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        raw["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    return raw


def load_gguf_tensors(
    gguf: Path, config: Any, raw_config: dict[str, Any], dtype: torch.dtype, fast: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of ``gguf``, dequantized to ``dtype``."""
    import numpy as np
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    try:
        tensors = _fast_tensors(gguf) if fast else None
        if tensors is None:
            tensors = _legacy_tensors(gguf)
        architecture, raw_tensors = tensors
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=raw_config)
        # An HF skeleton on the meta device only tells transformers the target names.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        mapping = _weights_map(skeleton, processor, config)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the tensors of {gguf}: {exc}") from exc
    scratch: dict[str, Any] = {"config": raw_config, "tensors": {}}
    for name, weights in raw_tensors:
        result = processor.process(
            weights=weights, name=name, tensor_key_mapping=mapping, parsed_parameters=scratch
        )
        if result.name not in mapping:
            continue
        yield mapping[result.name], torch.from_numpy(np.copy(result.weights)).to(dtype)


def _weights_map(skeleton: Any, processor: Any, config: Any) -> dict[str, str]:
    """``{gguf_name: hf_name}`` in one pass over the skeleton's parameter names.

    transformers' ``get_gguf_hf_weights_map`` rebuilds gguf's name table once per
    submodule (hundreds of times, tens of seconds); for the flat decoders here one
    table covers every name. Other architectures use transformers' function.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == config.model_type), None)
    if arch is None or config.model_type not in _FAST_ARCHS:
        return get_gguf_hf_weights_map(skeleton, processor)
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    mapping: dict[str, str] = {}
    for hf_name in skeleton.state_dict():
        name, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            name, dot, suffix = hf_name, "", ""
        gguf_name = table.get_name(name)
        if gguf_name is not None:
            mapping[gguf_name + dot + suffix] = hf_name
    return mapping


RawTensors = Iterator[tuple[str, Any]]


def _fast_tensors(gguf: Path) -> tuple[str, RawTensors] | None:
    reader = _fast_reader()
    if reader is None:
        return None
    import numpy as np
    from transformers.integrations.gguf import dequant

    header = reader.GgufHeader.from_file(str(gguf))
    lazy = reader.load_gguf_state_dict(header)

    def raw() -> RawTensors:
        for info in header.tensors:
            data = lazy[info.name].data
            if info.ggml_type == _GGML_F32:
                values = data.view(np.float32).reshape(info.shape)
            elif info.ggml_type == _GGML_F16:
                values = data.view(np.float16).astype(np.float32).reshape(info.shape)
            elif info.ggml_type == _GGML_BF16:
                bf16 = torch.from_numpy(np.array(data)).view(torch.bfloat16)
                values = bf16.float().reshape(info.shape).numpy()
            else:  # quantized blocks: transformers' torch dequantizer (flat bytes -> flat values)
                flat = dequant.dequantize(torch.from_numpy(np.array(data)), info.ggml_type)
                values = flat.reshape(info.shape).numpy()
            yield info.name, values

    return header.architecture, raw()


def _legacy_tensors(gguf: Path) -> tuple[str, RawTensors]:
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(gguf))
    architecture = read_field(reader, "general.architecture")[0]

    def raw() -> RawTensors:
        for tensor in reader.tensors:
            yield tensor.name, dequantize(tensor.data, tensor.tensor_type)

    return architecture, raw()
