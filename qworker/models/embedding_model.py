"""What the embedding engine needs from a model, and which architectures provide it.

An ``EmbeddingModel`` maps the step's packed tokens to final hidden states; pooling
(``qworker.models.pooling``) then makes one vector per input. Two families serve:
BERT-style encoders (``qworker.models.bert``: BERT, RoBERTa, XLM-RoBERTa) and the
decoders qworker already generates with, run without their LM head
(``qworker.models.decoder_embedder``).
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from qworker.models.packed_attention import PackedBatch

#: Encoder architectures (no causal LM: they can only embed) -> (module, class).
ENCODER_ARCHITECTURES: dict[str, tuple[str, str]] = {
    name: ("qworker.models.bert", "BertEmbedder")
    for name in ("BertModel", "BertForMaskedLM", "BertForPreTraining", "RobertaModel",
                 "RobertaForMaskedLM", "XLMRobertaModel", "XLMRobertaForMaskedLM")
}
ENCODER_MODEL_TYPES = {"bert": "BertModel", "roberta": "RobertaModel",
                       "xlm-roberta": "XLMRobertaModel"}

#: Decoder backbones without an LM head (transformers' ``*Model``): made to embed.
DECODER_BACKBONES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
#: Decoder architectures with an LM head that also embed when asked (task="embed").
DECODER_CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM")
DECODER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class EmbeddingModel(nn.Module):
    """A model that maps packed tokens to final hidden states, no KV cache kept.

    ``hidden_size``: width of the states; ``max_positions``: the longest input its
    position embeddings allow; ``is_encoder``: bidirectional (pools CLS by default)
    rather than causal (pools the last token). Parameter names follow transformers'
    so a checkpoint loads by name (``load_weights``).
    """

    hidden_size: int
    max_positions: int
    is_encoder: bool

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden_size]`` of the step's packed ``input_ids``."""

    @abstractmethod
    def load_weights(self, weights: Any) -> None:
        """Fill every parameter from ``(name, tensor)`` pairs; ``ModelLoadError`` when one
        is missing or a tensor has no place."""


def embedding_architecture(raw: dict[str, Any]) -> str | None:
    """The architecture of a raw ``config.json`` the embedding models serve, or None.

    Names in ``architectures`` decide; a config without them falls back to
    ``model_type`` (encoders only: a decoder's ``model_type`` alone does not say whether
    it was trained to embed).
    """
    names = raw.get("architectures") or []
    for name in names:
        if name in ENCODER_ARCHITECTURES or name in DECODER_BACKBONES \
                or name in DECODER_CAUSAL_LMS:
            return str(name)
    if not names:
        return ENCODER_MODEL_TYPES.get(raw.get("model_type", ""))
    return None


def embeds_only(architecture: str | None) -> bool:
    """Whether ``architecture`` has no LM head, so it cannot generate."""
    return architecture in ENCODER_ARCHITECTURES or architecture in DECODER_BACKBONES


def embedding_class(architecture: str) -> type[EmbeddingModel]:
    """The ``EmbeddingModel`` subclass serving ``architecture``."""
    if architecture in ENCODER_ARCHITECTURES:
        module, name = ENCODER_ARCHITECTURES[architecture]
    else:
        module, name = "qworker.models.decoder_embedder", "DecoderEmbedder"
    cls: type[EmbeddingModel] = getattr(importlib.import_module(module), name)
    return cls
