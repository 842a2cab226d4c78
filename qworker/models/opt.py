"""OPT (the PagedAttention paper's model family) with a paged KV cache.

Learned absolute positions (table offset by 2, as in fairseq), LayerNorm before or
after each block per ``do_layer_norm_before``, ReLU MLP, biases everywhere, an
optional ``word_embed_proj_dim`` projection around the decoder, and an LM head tied
to the token embeddings. Parameter names mirror transformers', with q/k/v fused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from qworker.attention.paged_attention import PagedAttention
from qworker.models.base import CausalLM, ModelSpec
from qworker.models.layers import FusedLinear, Linear, activation
from qworker.models.ops import linear
from qworker.models.tp_plan import ShardKind, ShardRule, TPPlan
from qworker.models.weights import StackedRule, check_all_loaded, load_weights

POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    """Multi-head self-attention over one layer's KV pages (queries pre-scaled, as OPT does)."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        dim = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = FusedLinear(dim, {"q": dim, "k": dim, "v": dim}, bias=bias)
        self.out_proj = Linear(dim, dim, bias=bias)
        # Scale 1: queries are scaled before the dot product (not inside it), matching
        # OPT's rounding.
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, 1.0, layer_idx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project, attend over the pages (cache write included), project out."""
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        return self.out_proj(self.attn(q * self.scaling, k, v))


class OPTDecoderLayer(nn.Module):
    """Attention then ReLU MLP, LayerNorm before (or after) each, with residuals."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        dim = config.hidden_size
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(config, "enable_bias", True))
        self.self_attn = OPTAttention(config, layer_idx)
        self.do_layer_norm_before = bool(config.do_layer_norm_before)
        self.self_attn_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.fc1 = Linear(dim, config.ffn_dim, bias=bias)
        self.fc2 = Linear(config.ffn_dim, dim, bias=bias)
        self.final_layer_norm = nn.LayerNorm(dim, elementwise_affine=affine)
        self.act = activation(getattr(config, "activation_function", "relu"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run the block over the step's tokens."""
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden)
        if not self.do_layer_norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.do_layer_norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    """Token and position embeddings, optional projections, layers, final LayerNorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        proj_dim = config.word_embed_proj_dim or config.hidden_size
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.embed_tokens = nn.Embedding(config.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, config.hidden_size
        )
        self.project_in: Linear | None = None
        self.project_out: Linear | None = None
        if proj_dim != config.hidden_size:
            self.project_in = Linear(proj_dim, config.hidden_size, bias=False)
            self.project_out = Linear(config.hidden_size, proj_dim, bias=False)
        self.final_layer_norm: nn.LayerNorm | None = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )


class OPTModel(nn.Module):
    """Holder matching transformers' ``model.decoder`` prefix."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    """OPT causal LM reading and writing a paged KV cache (build from an ``OPTConfig``)."""

    stacked_params: ClassVar[list[StackedRule]] = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
    ]
    tp_plan: ClassVar[TPPlan] = {
        "model.decoder.embed_tokens": ShardRule(ShardKind.VOCAB_EMBEDDING),
        "model.decoder.embed_positions": ShardRule(ShardKind.VOCAB_EMBEDDING),
        "model.decoder.layers.*.self_attn.qkv_proj": ShardRule(ShardKind.QKV),
        "model.decoder.layers.*.self_attn.out_proj": ShardRule(ShardKind.ROW),
        "model.decoder.layers.*.fc1": ShardRule(ShardKind.COLUMN, "ffn_dim"),
        "model.decoder.layers.*.fc2": ShardRule(ShardKind.ROW, "ffn_dim"),
        "lm_head": ShardRule(ShardKind.VOCAB_HEAD),
    }

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        proj_dim = config.word_embed_proj_dim or config.hidden_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = Linear(proj_dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.spec = ModelSpec(
            architecture=type(self).__name__,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.hidden_size // config.num_attention_heads,
            max_position_embeddings=config.max_position_embeddings,
            dtype=dtype,
            bos_token_id=getattr(config, "bos_token_id", None),
        )

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run every layer over the step's flattened tokens; return final hidden states."""
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            hidden = decoder.project_in(hidden)
        hidden = hidden + decoder.embed_positions(positions + POSITION_OFFSET)
        for layer in decoder.layers:
            hidden = layer(hidden)
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[n, hidden]`` to fp32 logits ``[n, vocab_size]``."""
        return linear(hidden, self.lm_head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from transformers-named tensors; raise if any is missing."""
        skip: tuple[str, ...] = ("lm_head.weight",) if self.tie_word_embeddings else ()
        loaded = load_weights(self, _with_model_prefix(weights), self.stacked_params, skip)
        check_all_loaded(self, loaded)


def _with_model_prefix(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    # Original facebook/opt checkpoints name tensors "decoder.*" without "model.".
    for name, tensor in weights:
        yield (f"model.{name}" if name.startswith("decoder.") else name), tensor
