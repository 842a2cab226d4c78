"""Rotary position embeddings: one cos/sin table per model, indexed by token positions.

The inverse frequencies come from ``transformers``' own RoPE initialisers, so every
scaling type they define statically (default, linear, llama3, yarn)
matches them bit for bit in fp32. Types whose frequencies depend on the current
sequence length (``dynamic``, ``longrope``) are refused with a clear error rather than
silently approximated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qworker.errors import ModelLoadError
from qworker.models.ops import apply_rope

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The model's RoPE settings as one dict, whichever form the config uses.

    transformers 5 keeps them in ``config.rope_parameters`` (``rope_type``,
    ``rope_theta``, ...); older configs carry ``rope_scaling`` plus ``rope_theta``.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and not _is_per_layer(params):
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


def compute_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, ``[rotary_dim // 2]``) and the cos/sin scaling factor.

    Raises ``ModelLoadError`` for RoPE types that need per-length recomputation.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"rope_scaling {params!r} is incomplete: {exc}") from exc
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE tables for query and key rows ``[num_tokens, heads, head_dim]``.

    The cos/sin table covers ``max_positions`` and is computed once on the CPU in fp32,
    then moved to the activations' device and dtype on first use (it is deliberately
    not a buffer, so building a model on the ``meta`` device and materialising it with
    ``to_empty`` keeps it valid).
    """

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # Computed on the CPU even when the model is being built on the meta device.
        with torch.device("cpu"):
            inv_freq, scaling = compute_inv_freq(config, head_dim)
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
