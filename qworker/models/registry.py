"""Which model class serves which HF architecture name (and GGUF/config ``model_type``)."""

from __future__ import annotations

import importlib
from typing import Any

from qworker.errors import ModelLoadError

# architecture name -> (module, class); classes import lazily so OPT's module stays optional.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("qworker.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("qworker.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qworker.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qworker.models.llama", "Qwen3ForCausalLM"),
    "OPTForCausalLM": ("qworker.models.opt", "OPTForCausalLM"),
    "Phi3ForCausalLM": ("qworker.models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("qworker.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("qworker.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("qworker.models.gemma", "Gemma3ForConditionalGeneration"),
    "MixtralForCausalLM": ("qworker.models.moe_models", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qworker.models.moe_models", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qworker.models.moe_models", "Qwen3MoeForCausalLM"),
}

#: Architectures loaded from safetensors only: their GGUF conversions (norm offsets, fused
#: tensors, expert layouts) are not tested here, so a GGUF of them is refused rather than risked.
SAFETENSORS_ONLY = frozenset({
    "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
})

_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "opt": "OPTForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    """The architecture names ``load_model`` accepts."""
    return sorted(_ARCHITECTURES)


def resolve_architecture(config: dict[str, Any]) -> str:
    """The supported architecture a raw ``config.json`` dict names, or ``ModelLoadError``.

    ``architectures[0]`` decides; a config without it falls back to ``model_type``.
    """
    names = config.get("architectures") or []
    model_type = config.get("model_type")
    for name in names:
        if name in _ARCHITECTURES:
            return name
    if not names and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    shown = names[0] if names else f"model_type={model_type!r}"
    raise ModelLoadError(
        f"unsupported model architecture {shown}; supported: {', '.join(supported_architectures())}"
    )


def model_class(architecture: str) -> type:
    """The ``CausalLM`` subclass for ``architecture`` (a name from ``supported_architectures``)."""
    try:
        module_name, class_name = _ARCHITECTURES[architecture]
    except KeyError as exc:
        raise ModelLoadError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        ) from exc
    return getattr(importlib.import_module(module_name), class_name)
