"""Gemma 2 and Gemma 3 (text) with a paged KV cache, following transformers' modeling code.

What sets them apart from the Llama family (``qworker.models.llama``), each as
transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py`` computes it:

* embeddings times ``sqrt(hidden_size)``, the factor rounded to the model dtype first;
* RMSNorm scaled by ``1 + weight`` in fp32 (``GemmaRMSNorm``), and two more norms per
  block: the attention and MLP outputs are normalised before their residual adds;
* a gated GELU-tanh MLP (``hidden_activation``);
* attention scale ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps every layer's
  attention scores (``attn_logit_softcapping``) and both soft-cap the final logits
  (``final_logit_softcapping``): ``cap * tanh(x / cap)``;
* sliding-window and global layers per ``layer_types`` (which transformers derives from
  ``sliding_window_pattern`` for configs written before it existed); Gemma 3 rotates
  sliding layers with their own RoPE (``rope_local_base_freq`` in older configs) and
  global ones with ``rope_theta`` and ``rope_scaling``, and normalises queries and keys
  per head (``q_norm`` / ``k_norm``).

Gemma 3's transformers code ignores ``attn_logit_softcapping`` (it never passes it to its
attention), so this code does too (logged). ``Gemma3ForConditionalGeneration``
checkpoints load their text tower only (``text_config``; vision tensors are skipped):
text prompts give what transformers' multimodal model gives for them, and that model
(transformers 5) does not apply ``final_logit_softcapping`` either (the released Gemma 3
checkpoints set neither cap). Bidirectional
configs (``use_bidirectional_attention``, EmbeddingGemma) are refused. See
docs/models.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from qworker.attention.paged_attention import PagedAttention
from qworker.errors import ModelLoadError
from qworker.models.base import CausalLM, ModelSpec
from qworker.models.layers import FusedLinear, Linear, activation
from qworker.models.ops import gated_act, linear, rotate_qk
from qworker.models.rope import RotaryEmbedding, original_max_positions, rope_parameters
from qworker.models.tp_plan import ShardKind, ShardRule, TPPlan
from qworker.models.weights import StackedRule, check_all_loaded, load_weights

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"

#: The step's RoPE state of one layer type (as ``qworker.models.llama.RopeStep``).
RopeStep = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], list[torch.Tensor]]


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, the op order of transformers' Gemma."""
    return torch.tanh(x / cap) * cap


def gemma_layer_types(config: Any) -> list[str]:
    """Each layer's type, ``"sliding_attention"`` or ``"full_attention"``.

    ``layer_types`` when the config has it; else transformers' derivation for configs
    written before it existed: every ``sliding_window_pattern``-th layer is global
    (Gemma 2: every second, Gemma 3: every sixth by default).
    """
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        default = 2 if config.model_type == "gemma2" else 6
        pattern = (getattr(config, "sliding_window_pattern", None)
                   or getattr(config, "_sliding_window_pattern", None) or default)
        types = [SLIDING if (i + 1) % int(pattern) else FULL for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ModelLoadError(f"layer_types {unknown} are not supported; supported: "
                             f"{SLIDING}, {FULL}")
    return types


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class GemmaRMSNorm(nn.Module):
    """RMSNorm times ``1 + weight``, all in fp32 and rounded once, as transformers' Gemma
    (the checkpoint stores the zero-centred ``weight``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension, scale by ``1 + weight``."""
        scale = 1.0 + self.weight.float()
        if x.dtype == torch.float32:  # one op; the same rounding as the form below
            return F.rms_norm(x, (x.shape[-1],), scale, self.eps)
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * scale).to(x.dtype)


class GemmaAttention(nn.Module):
    """GQA self-attention with Gemma's scale, optional q/k norms (Gemma 3) and soft-cap
    (Gemma 2), over one layer's KV pages."""

    def __init__(self, config: Any, layer_idx: int, sliding_window: int | None,
                 logits_soft_cap: float | None, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = _head_dim(config)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = FusedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias
        )
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        scale = float(config.query_pre_attn_scalar) ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                                   layer_idx, sliding_window, logits_soft_cap)

    def forward(self, hidden: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """Project, normalise q/k (Gemma 3), rotate, attend (cache write included), project
        out."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotate_qk(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))


class GemmaMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))`` with gate and up fused, GELU-tanh for Gemma."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = FusedLinear(config.hidden_size, {"gate": inter, "up": inter},
                                        bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self.act = activation(name or "gelu_pytorch_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP to ``[num_tokens, hidden]``."""
        return self.down_proj(gated_act(self.gate_up_proj(x), self.act))


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-normed block: ``h += post_attn_norm(attn(input_norm(h)))``, then
    ``h += post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def __init__(self, config: Any, layer_idx: int, layer_type: str,
                 logits_soft_cap: float | None, qk_norm: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        window = config.sliding_window if layer_type == SLIDING else None
        self.self_attn = GemmaAttention(config, layer_idx, window, logits_soft_cap, qk_norm)
        self.mlp = GemmaMLP(config)
        eps, dim = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, hidden: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """The block's output (the residual stream after both sub-blocks)."""
        attn = self.self_attn(self.input_layernorm(hidden), rope)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    """Scaled embeddings, decoder layers, the final norm (transformers' ``model.``)."""

    def __init__(self, config: Any, logits_soft_cap: float | None, qk_norm: bool,
                 per_type_rope: bool) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layer_types = gemma_layer_types(config)
        self.per_type_rope = per_type_rope
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, t, logits_soft_cap, qk_norm)
            for i, t in enumerate(self.layer_types)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary: dict[str | None, RotaryEmbedding] = {}
        self.build_rotary(config.max_position_embeddings)
        self._normalizer: torch.Tensor | None = None

    def _rope_keys(self) -> list[str | None]:
        return sorted(set(self.layer_types)) if self.per_type_rope else [None]

    def build_rotary(self, context_len: int) -> None:
        """(Re)build the RoPE tables of every layer type for a ``context_len``-token
        context (a longrope type takes its long factors past its original length)."""
        config, head_dim = self.config, _head_dim(self.config)
        for key in self._rope_keys():
            original = original_max_positions(config, key)
            self.rotary[key] = RotaryEmbedding(
                config, head_dim, config.max_position_embeddings, layer_type=key,
                long_context=original is not None and context_len > original)

    def normalizer(self, like: torch.Tensor) -> torch.Tensor:
        """``sqrt(hidden_size)`` as a 0-d tensor in ``like``'s dtype and device: transformers
        rounds it to the model dtype before multiplying."""
        norm = self._normalizer
        if norm is None or norm.dtype != like.dtype or norm.device != like.device:
            norm = torch.tensor(self.config.hidden_size**0.5).to(device=like.device,
                                                                 dtype=like.dtype)
            self._normalizer = norm
        return norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states of the step's flattened tokens."""
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * self.normalizer(hidden)
        ropes: dict[str | None, RopeStep] = {
            key: (positions, rotary.tables(hidden), []) for key, rotary in self.rotary.items()
        }
        for layer in self.layers:
            hidden = layer(hidden, ropes[layer.layer_type if self.per_type_rope else None])
        return self.norm(hidden)


def _text_config(config: Any) -> Any:
    """The language model's config: ``text_config`` of a multimodal Gemma 3 config."""
    text = getattr(config, "text_config", None)
    return text if text is not None and config.model_type == "gemma3" else config


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2: soft-capped attention and final logits, alternating local/global layers.

    Construct from a transformers ``Gemma2Config``; parameters start uninitialised (fill
    them with ``load_weights``)."""

    stacked_params: ClassVar[list[StackedRule]] = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", "gate"),
        (".up_proj.", ".gate_up_proj.", "up"),
    ]
    #: Llama's split (docs/tensor_parallel.md). The extra norms, q/k norms and soft-caps
    #: are element-wise and replicated; the embedding scale multiplies the embedding's
    #: all-reduced output, as the model scales the lookup.
    tp_plan: ClassVar[TPPlan] = {
        "model.embed_tokens": ShardRule(ShardKind.VOCAB_EMBEDDING),
        "model.layers.*.self_attn.qkv_proj": ShardRule(ShardKind.QKV),
        "model.layers.*.self_attn.o_proj": ShardRule(ShardKind.ROW),
        "model.layers.*.mlp.gate_up_proj": ShardRule(ShardKind.COLUMN, "intermediate_size"),
        "model.layers.*.mlp.down_proj": ShardRule(ShardKind.ROW, "intermediate_size"),
        "lm_head": ShardRule(ShardKind.VOCAB_HEAD),
    }
    #: Gemma 2 soft-caps attention scores; Gemma 3 has q/k norms and per-type RoPE; the
    #: multimodal Gemma 3 model of transformers does not soft-cap its logits.
    attention_soft_cap: ClassVar[bool] = True
    final_soft_cap: ClassVar[bool] = True
    qk_norm: ClassVar[bool] = False
    per_type_rope: ClassVar[bool] = False

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.full_config = config
        config = _text_config(config)
        self.config = config
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError(
                "use_bidirectional_attention=True (an embedding model) is not supported: "
                "qworker serves causal language models")
        cap = self._cap(config, "attn_logit_softcapping", self.attention_soft_cap)
        self.logits_soft_cap = self._cap(config, "final_logit_softcapping", self.final_soft_cap)
        self.model = GemmaModel(config, cap, self.qk_norm, self.per_type_rope)
        self.tie_word_embeddings = bool(getattr(self.full_config, "tie_word_embeddings", True))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        windows = [layer.self_attn.attn.sliding_window for layer in self.model.layers]
        uniform = windows[0] if windows and all(w == windows[0] for w in windows) else None
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
            sliding_window=uniform,
        )

    def _cap(self, config: Any, name: str, honoured: bool) -> float | None:
        """The config's soft-cap ``name`` if this architecture applies it (else logged and
        None, as transformers ignores it there); a non-positive cap is refused."""
        value = getattr(config, name, None)
        if value is None:
            return None
        if not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"{name} must be a positive number or null, got {value!r}")
        if not honoured:
            logger.info("%s: %s=%s is ignored, as transformers ignores it for this "
                        "architecture", type(self).__name__, name, value)
            return None
        return float(value)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config ties them."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_max_model_len(self, max_model_len: int) -> None:
        """A ``longrope`` layer type picks its factors by the engine's context length."""
        types = [None] if not self.per_type_rope else sorted(set(self.model.layer_types))
        if any(rope_parameters(self.config, t)["rope_type"] == "longrope" for t in types):
            self.model.build_rotary(max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run every layer over the step's flattened tokens; return final hidden states."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[n, vocab_size]``, soft-capped (in fp32) when the config says so."""
        logits = linear(hidden, self.lm_head.weight).float()
        if self.logits_soft_cap is not None:
            logits = soft_cap(logits, self.logits_soft_cap)
        return logits

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as this model's (the text tower of multimodal checkpoints:
        ``model.language_model.*`` or ``language_model.model.*``; vision tensors dropped)."""
        for name, tensor in weights:
            for old, new in (("model.language_model.", "model."),
                             ("language_model.model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            else:
                if name.startswith(("vision_tower.", "multi_modal_projector.",
                                    "model.vision_tower.", "model.multi_modal_projector.")):
                    continue
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from transformers-named tensors; raise if any is missing."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip = (*skip, "lm_head.weight")
        loaded = load_weights(self, self._renamed(weights), self.stacked_params, skip)
        check_all_loaded(self, loaded)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): q/k norms, per-layer-type RoPE, no attention soft-cap."""

    attention_soft_cap = False
    qk_norm = True
    per_type_rope = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text tower of a multimodal Gemma 3 checkpoint (``text_config``); text only, no
    final soft-cap (as transformers' multimodal Gemma 3)."""

    final_soft_cap = False
