"""What the engine needs from a model: its shape (``ModelSpec``) and a paged forward."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from qworker.models.tp_plan import TPPlan


@dataclass(slots=True)
class ModelSpec:
    """The facts about a loaded model that sizing, scheduling and sampling rely on."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    sliding_window: int | None = None


class CausalLM(nn.Module, ABC):
    """A decoder-only language model that reads and writes a paged KV cache.

    ``forward`` takes the step's flattened tokens (``input_ids`` and ``positions``,
    int64 ``[num_tokens]``) and returns final hidden states ``[num_tokens, hidden]``.
    Its attention goes through one ``PagedAttention`` layer per decoder layer
    (``qworker.attention.paged_attention``): the runner binds them to the KV pool and
    backend and sets the step's metadata around the call. ``compute_logits`` maps
    selected hidden states to fp32 logits ``[n, vocab_size]``.
    """

    spec: ModelSpec
    #: How the model splits over tensor-parallel ranks (``qworker.models.tp_plan``);
    #: None: not yet, so ``tensor_parallel_size`` must be 1.
    tp_plan: ClassVar[TPPlan | None] = None

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run every layer over the step's tokens; return final hidden states."""

    def graph_capturable(self, device: torch.device) -> bool:
        """Whether the forward runs on ``device`` without host syncs, so CUDA graphs can
        capture it (models with a host-synced fallback path override this)."""
        return True

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[n, hidden]`` to fp32 logits ``[n, vocab_size]``."""

    def set_max_model_len(self, max_model_len: int) -> None:
        """Told once by the engine, before the first forward, how long its sequences may
        grow (``max_model_len`` tokens). Models whose numerics depend on it override this
        (longrope picks its short or long factors by it); the default ignores it."""
