"""The Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) as embedding models.

The decoder stack of ``qworker.models.llama`` without its LM head, each layer's
``PagedAttention`` swapped for causal ``PackedAttention`` (no KV cache: an embedding
is one prefill). Checkpoints of transformers' ``*Model`` classes (Qwen3-Embedding's
``layers.N...`` names) and of ``*ForCausalLM`` (``model.layers.N...``, the LM head
ignored) both load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from qworker.errors import ModelLoadError
from qworker.models.embedding_model import DECODER_MODEL_TYPES, EmbeddingModel
from qworker.models.llama import LlamaForCausalLM, LlamaModel
from qworker.models.packed_attention import PackedAttention, PackedBatch, packed_context
from qworker.models.weights import check_all_loaded, load_weights


class DecoderEmbedder(EmbeddingModel):
    """A Llama-family decoder returning the final (normed) hidden states of packed inputs.

    Construct from a transformers ``LlamaConfig``/``MistralConfig``/``Qwen2Config``/
    ``Qwen3Config``; parameters start uninitialised (fill them with ``load_weights``).
    """

    is_encoder = False

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.model_type not in DECODER_MODEL_TYPES:
            raise ModelLoadError(f"model_type {config.model_type!r} cannot embed; decoders "
                                 f"that can: {', '.join(DECODER_MODEL_TYPES)}")
        self.config = config
        self.model = LlamaModel(config)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.attn = PackedAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        attn.head_dim**-0.5, causal=True,
                                        sliding_window=attn.attn.sliding_window)
        self.hidden_size = config.hidden_size
        self.max_positions = config.max_position_embeddings
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (after the last norm) of the packed tokens."""
        with packed_context(batch):
            return self.model(input_ids, batch.positions)

    def tie_weights(self) -> None:
        """Nothing is tied without an LM head (the loader calls this after materialising)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Fill every parameter from a ``*Model`` or ``*ForCausalLM`` checkpoint."""
        loaded = load_weights(self, _renamed(weights), LlamaForCausalLM.stacked_params,
                              ("rotary_emb.inv_freq", "lm_head."))
        check_all_loaded(self, loaded)


def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        yield (name if name.startswith(("model.", "lm_head.")) else "model." + name), tensor
