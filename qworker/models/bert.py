"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over packed inputs, for embeddings.

Post-norm transformer blocks as transformers' ``BertModel``: embeddings (word +
position + token type 0, LayerNorm), then per layer ``LN(x + out(attn(x)))`` and
``LN(h + down(act(up(h))))``. q/k/v are fused into one matmul (``qkv``), so on the CPU
each layer is four packed fp32 matmuls (``qworker.models.cpu_gemm``). RoBERTa and
XLM-RoBERTa number positions from ``pad_token_id + 1`` (their position table keeps the
first rows for padding), so their longest input is ``max_position_embeddings -
pad_token_id - 1``. Every input is one segment (token type 0). The pooler (dense +
tanh over CLS) and any masked-LM head in the checkpoint are skipped: sentence-
transformers pools the hidden states, not the pooler (docs/embeddings.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from qworker.models.embedding_model import EmbeddingModel
from qworker.models.layers import FusedLinear, Linear, activation
from qworker.models.packed_attention import PackedAttention, PackedBatch
from qworker.models.weights import StackedRule, check_all_loaded, load_weights

#: Checkpoint prefixes of the task-head classes (BertForMaskedLM, XLMRobertaForMaskedLM).
_PREFIXES = ("bert.", "roberta.")
#: Checkpoint tensors an embedding never reads.
_SKIPPED = ("pooler.", "cls.", "lm_head.", "position_ids", "token_type_ids")


class BertEmbeddings(nn.Module):
    """Word + position + token-type-0 embeddings, then LayerNorm."""

    def __init__(self, config: Any, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, config.type_vocab_size),
                                                  config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embed ``input_ids`` ``[T]`` at per-input ``positions`` ``[T]``."""
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """Fused q/k/v projection and bidirectional attention within each input."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        heads = config.num_attention_heads
        head_dim = config.hidden_size // heads
        size = heads * head_dim
        self.qkv = FusedLinear(config.hidden_size, {"q": size, "k": size, "v": size}, bias=True)
        self.attn = PackedAttention(heads, heads, head_dim, head_dim**-0.5, causal=False)

    def forward(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Attention outputs ``[T, hidden]`` before the output projection."""
        q, k, v = self.qkv(hidden).split(self.qkv.split_sizes, dim=-1)
        return self.attn(q, k, v, batch)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)`` (transformers' ``BertSelfOutput``/``BertOutput``)."""

    def __init__(self, in_features: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Project, add the residual, normalise."""
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Self-attention plus its output block (names as transformers': ``self``, ``output``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseNorm(config.hidden_size, config.hidden_size,
                                    config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """The block's output (residual and norm included)."""
        return self.output(self.self(hidden, batch), hidden)


class BertIntermediate(nn.Module):
    """The feed-forward block's up projection and activation."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``act(up(x))``."""
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """One post-norm encoder block."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseNorm(config.intermediate_size, config.hidden_size,
                                    config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """The block's output ``[T, hidden]``."""
        attended = self.attention(hidden, batch)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    """The stack of blocks (transformers' ``encoder.layer.N``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertEmbedder(EmbeddingModel):
    """A BERT/RoBERTa/XLM-RoBERTa encoder returning final hidden states of packed inputs.

    Construct from a transformers ``BertConfig``/``RobertaConfig``/``XLMRobertaConfig``;
    parameters start uninitialised (fill them with ``load_weights``).
    """

    is_encoder = True
    stacked_params: ClassVar[list[StackedRule]] = [
        (".attention.self.query.", ".attention.self.qkv.", "q"),
        (".attention.self.key.", ".attention.self.qkv.", "k"),
        (".attention.self.value.", ".attention.self.qkv.", "v"),
    ]

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
            from qworker.errors import ModelLoadError

            raise ModelLoadError(f"position_embedding_type "
                                 f"{config.position_embedding_type!r} is not supported")
        self.config = config
        offset = 0
        if config.model_type in ("roberta", "xlm-roberta"):
            offset = int(config.pad_token_id) + 1
        self.embeddings = BertEmbeddings(config, offset)
        self.encoder = BertEncoder(config)
        self.hidden_size = config.hidden_size
        self.max_positions = config.max_position_embeddings - offset
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's packed tokens."""
        hidden = self.embeddings(input_ids, batch.positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch)
        return hidden

    def tie_weights(self) -> None:
        """Nothing is tied (the loader calls this after materialising)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Fill every parameter from a BERT-family checkpoint (task-head prefixes and the
        pooler/LM head are dropped; old ``gamma``/``beta`` LayerNorm names mapped)."""
        loaded = load_weights(self, _renamed(weights), self.stacked_params, _SKIPPED)
        check_all_loaded(self, loaded)


def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.endswith(".gamma"):
            name = name[: -len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[: -len("beta")] + "bias"
        yield name, tensor

