"""Rotary position embeddings: one cos/sin table per model, indexed by token positions.

The inverse frequencies come from ``transformers``' own RoPE initialisers, so every
scaling type they define statically (default, linear, llama3, yarn)
matches them bit for bit in fp32. ``longrope`` (Phi-3's ``su``) has two frequency sets,
short and long; transformers picks one per forward by the largest position in it, so a
sequence crossing ``original_max_position_embeddings`` mid-generation mixes keys rotated
with both. The engine picks once, by its context length (``long_context``: vLLM's
choice): long factors when ``max_model_len`` exceeds the original length, short ones
otherwise, for every position of every sequence (docs/models.md). ``dynamic`` (NTK),
whose frequencies depend on the current length, is refused with a clear error rather
than silently approximated. Models with per-layer-type RoPE (Gemma 3:
``rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}``) build one
table per type (``layer_type``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qworker.errors import ModelLoadError
from qworker.models.ops import apply_rope

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The model's RoPE settings as one dict, whichever form the config uses.

    transformers 5 keeps them in ``config.rope_parameters`` (``rope_type``,
    ``rope_theta``, ...); older configs carry ``rope_scaling`` plus ``rope_theta``.
    ``layer_type`` picks one entry of a per-layer-type dict (Gemma 3).
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and _is_per_layer(params) and layer_type is not None:
        if not isinstance(params.get(layer_type), dict):
            raise ModelLoadError(f"rope_parameters has no entry for layer type {layer_type!r}")
        out = dict(params[layer_type])
    elif isinstance(params, dict) and params and not _is_per_layer(params):
        out = dict(params)
    else:
        scaling = getattr(config, "rope_scaling", None)
        out = dict(scaling) if isinstance(scaling, dict) else {}
    if "rope_type" not in out:
        out["rope_type"] = out.pop("type", "default")
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(config, "rope_theta", None) or getattr(
            config, "default_theta", 10000.0
        )
    return out


def _is_per_layer(params: dict[str, Any]) -> bool:
    return all(isinstance(v, dict) for v in params.values())


def original_max_positions(config: Any, layer_type: str | None = None) -> int | None:
    """The pre-training length a ``longrope`` model switches factors at (None for other
    RoPE types)."""
    params = rope_parameters(config, layer_type)
    if params["rope_type"] != "longrope":
        return None
    value = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if value is None:
        raise ModelLoadError("longrope rope_parameters lack original_max_position_embeddings")
    return int(value)


def compute_inv_freq(config: Any, head_dim: int, *, layer_type: str | None = None,
                     long_context: bool = False, partial_rotary: bool = False
                     ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, ``[rotary_dim // 2]``) and the cos/sin scaling factor.

    ``layer_type``: the entry of per-layer-type RoPE settings; ``long_context``: longrope's
    long factors (else its short ones); ``partial_rotary``: the model rotates only the
    first ``partial_rotary_factor`` of each head (Phi-3/4), else such a config is refused.
    Raises ``ModelLoadError`` for RoPE types that need per-length recomputation.
    """
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0 and not partial_rotary:
        raise ModelLoadError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs: dict[str, Any] = {}
    if layer_type is not None and _is_per_layer(getattr(config, "rope_parameters", None) or {}):
        kwargs["layer_type"] = layer_type
    if rope_type == "longrope" and long_context:
        # transformers' own switch: a length past the original selects the long factors
        kwargs["seq_len"] = original_max_positions(config, layer_type) + 1
    try:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](
            config, torch.device("cpu"), **kwargs)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ModelLoadError(f"rope_scaling {params!r} is incomplete: {exc}") from exc
    if inv_freq.numel() * 2 != int(head_dim * partial):
        raise ModelLoadError(f"rope_scaling {params!r} gives {inv_freq.numel()} frequencies, "
                             f"the heads rotate {int(head_dim * partial)} dimensions")
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE tables for query and key rows ``[num_tokens, heads, head_dim]``.

    The cos/sin table covers ``max_positions`` and is computed once on the CPU in fp32,
    then moved to the activations' device and dtype on first use (it is deliberately
    not a buffer, so building a model on the ``meta`` device and materialising it with
    ``to_empty`` keeps it valid).
    """

    def __init__(self, config: Any, head_dim: int, max_positions: int, *,
                 layer_type: str | None = None, long_context: bool = False,
                 partial_rotary: bool = False) -> None:
        """``layer_type``, ``long_context`` and ``partial_rotary`` as in
        ``compute_inv_freq``."""
        super().__init__()
        # Computed on the CPU even when the model is being built on the meta device.
        with torch.device("cpu"):
            inv_freq, scaling = compute_inv_freq(config, head_dim, layer_type=layer_type,
                                                 long_context=long_context,
                                                 partial_rotary=partial_rotary)
            pos = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = pos[:, None] * inv_freq[None, :]
            # Same op order as transformers (cos() then * scaling) for bitwise fp32 parity.
            self._cos_cpu = freqs.cos() * scaling
            self._sin_cpu = freqs.sin() * scaling
        self.max_positions = max_positions
        self._cos = self._cos_cpu
        self._sin = self._sin_cpu

    def tables(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables ``[max_positions, rotary_dim / 2]`` in ``like``'s dtype and
        device (moved there once)."""
        if self._cos.device != like.device or self._cos.dtype != like.dtype:
            self._cos = self._cos_cpu.to(device=like.device, dtype=like.dtype)
            self._sin = self._sin_cpu.to(device=like.device, dtype=like.dtype)
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, rotary_dim / 2]`` of ``positions`` in ``like``'s
        dtype and device: gathered once per step and shared by every layer."""
        cos_t, sin_t = self.tables(like)
        return cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` and ``key`` by their tokens' ``positions`` (int64 ``[num_tokens]``)."""
        cos, sin = self.cos_sin(positions, query)
        return apply_rope(query, cos, sin), apply_rope(key, cos, sin)
