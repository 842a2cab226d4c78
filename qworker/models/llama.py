"""The Llama family (Llama, Mistral, Qwen2, Qwen3; Phi-3/4 in ``phi3``) with a paged KV cache.

One implementation covers them: they differ only in configuration (attention bias,
per-head q/k RMSNorm for Qwen3, sliding windows, RoPE scaling, partial rotary), which
is read from the transformers config object. Parameter names mirror transformers' so a
checkpoint loads by name, except that q/k/v and gate/up are fused into one matmul
each (``qkv_proj``, ``gate_up_proj``) for speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from qworker.attention.paged_attention import PagedAttention
from qworker.models.base import CausalLM, ModelSpec
from qworker.models.layers import FusedLinear, Linear, RMSNorm, activation
from qworker.models.ops import gated_act, linear, rotate_qk
from qworker.models.rope import RotaryEmbedding, original_max_positions
from qworker.models.tp_plan import ShardKind, ShardRule, TPPlan
from qworker.models.weights import StackedRule, check_all_loaded, load_weights

#: The step's RoPE state: positions, cos/sin tables, and the cos/sin gathered at the first
#: layer that needs them (``qworker.models.ops.rotate_qk``).
RopeStep = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], list[torch.Tensor]]

#: Builds one layer's feed-forward block from the config and the layer index.
MlpBuilder = Callable[[Any, int], nn.Module]


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _attention_biases(config: Any) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias): Qwen2 always biases q/k/v (Qwen2-MoE per ``qkv_bias``)
    and never o_proj; the others follow ``attention_bias``."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    if config.model_type == "qwen2":
        return True, False
    if config.model_type == "qwen2_moe":
        return bool(getattr(config, "qkv_bias", True)), False
    return attention_bias, attention_bias


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window in tokens (None: full attention).

    Mistral applies ``sliding_window`` to every layer; Qwen2/Qwen3 only when
    ``use_sliding_window`` is set, and then per ``layer_types``.
    """
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is None or (hasattr(config, "use_sliding_window") and not config.use_sliding_window):
        return [None] * n
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * n


class LlamaAttention(nn.Module):
    """Self-attention with GQA/MQA, RoPE and optional q/k norm, over one layer's KV pages."""

    def __init__(self, config: Any, layer_idx: int, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = _head_dim(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias, o_bias = _attention_biases(config)
        self.qkv_proj = FusedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        if config.model_type in ("qwen3", "qwen3_moe"):
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5, layer_idx, sliding_window)

    @property
    def sliding_window(self) -> int | None:
        """This layer's attention window in tokens (None: full attention)."""
        return self.attn.sliding_window

    def forward(self, hidden: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """Project, rotate (``rope``: the step's positions, tables and cos/sin cache),
        attend (cache write included), project out."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotate_qk(q, k, *rope)
        out = self.attn(q, k, v)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate": inter, "up": inter}, bias=bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        self.act = activation(getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to ``[num_tokens, hidden]``."""
        return self.down_proj(gated_act(self.gate_up_proj(x), self.act))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual.

    The residual stream is carried between layers unnormalised and added inside the
    next norm (``add_rms_norm``), so each layer costs two fused norm steps.
    """

    def __init__(self, config: Any, layer_idx: int, sliding_window: int | None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, sliding_window)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RopeStep
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block; returns ``(mlp output, residual)`` whose sum is the block's output."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm.add(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' ``model.`` prefix).

    ``partial_rotary``: RoPE may cover only part of each head (Phi-3/4's
    ``partial_rotary_factor``); ``build_mlp(config, layer_idx)`` replaces the dense MLP
    of a layer (the MoE decoders)."""

    def __init__(self, config: Any, partial_rotary: bool = False,
                 build_mlp: MlpBuilder | None = None) -> None:
        super().__init__()
        self.config = config
        self.partial_rotary = partial_rotary
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = self.build_rotary(config.max_position_embeddings)
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, windows[i], build_mlp(config, i) if build_mlp else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_rotary(self, context_len: int) -> RotaryEmbedding:
        """RoPE tables for a context of ``context_len`` tokens: a ``longrope`` model takes
        its long factors when that exceeds its original length (``qworker.models.rope``)."""
        config = self.config
        original = original_max_positions(config)
        return RotaryEmbedding(config, _head_dim(config), config.max_position_embeddings,
                               long_context=original is not None and context_len > original,
                               partial_rotary=self.partial_rotary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states of the step's flattened tokens."""
        hidden = self.embed_tokens(input_ids)
        rope: RopeStep = (positions, self.rotary.tables(hidden), [])  # shared by the layers
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    """Llama-architecture causal LM reading and writing a paged KV cache.

    Construct from a transformers config (``LlamaConfig``, ``MistralConfig``,
    ``Qwen2Config``, ``Qwen3Config``); parameters start uninitialised: fill them with
    ``load_weights``. ``dtype`` is recorded in ``spec`` (the loader casts the module).
    """

    stacked_params: ClassVar[list[StackedRule]] = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", "gate"),
        (".up_proj.", ".gate_up_proj.", "up"),
    ]
    tp_plan: ClassVar[TPPlan] = {
        "model.embed_tokens": ShardRule(ShardKind.VOCAB_EMBEDDING),
        "model.layers.*.self_attn.qkv_proj": ShardRule(ShardKind.QKV),
        "model.layers.*.self_attn.o_proj": ShardRule(ShardKind.ROW),
        "model.layers.*.mlp.gate_up_proj": ShardRule(ShardKind.COLUMN, "intermediate_size"),
        "model.layers.*.mlp.down_proj": ShardRule(ShardKind.ROW, "intermediate_size"),
        "lm_head": ShardRule(ShardKind.VOCAB_HEAD),
    }

    #: Whether RoPE may cover only part of each head (Phi-3/4).
    partial_rotary: ClassVar[bool] = False

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.partial_rotary, self.build_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        windows = layer_sliding_windows(config)
        uniform_window = windows[0] if windows and all(w == windows[0] for w in windows) else None
        self.spec = ModelSpec(
            architecture=type(self).__name__,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=_head_dim(config),
            max_position_embeddings=config.max_position_embeddings,
            dtype=dtype,
            bos_token_id=getattr(config, "bos_token_id", None),
            sliding_window=uniform_window,
        )

    def build_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block (the MoE models override it)."""
        return LlamaMLP(config)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_max_model_len(self, max_model_len: int) -> None:
        """A ``longrope`` model picks its short or long factors by the engine's context
        length (see ``qworker.models.rope``); other RoPE types are unaffected."""
        if original_max_positions(self.config) is not None:
            self.model.rotary = self.model.build_rotary(max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run every layer over the step's flattened tokens; return final hidden states."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[n, hidden]`` to fp32 logits ``[n, vocab_size]``."""
        return linear(hidden, self.lm_head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from transformers-named tensors; raise if any is missing."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        loaded = load_weights(self, weights, self.stacked_params, skip)
        check_all_loaded(self, loaded)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding attention window on every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases and optional per-layer sliding windows."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on queries and keys before RoPE."""
