"""Which attention backend an engine gets for its ``attention_backend`` setting.

"auto" is the CUDA kernels on a GPU (the torch reference if they do not import) and
the batched CPU backend elsewhere; "torch" is always the reference, "cpu" the batched
backend, "cuda" the kernels (an error off a GPU). See docs/configuration.md.
"""

from __future__ import annotations

import logging

import torch

from qworker.attention.backend import AttentionBackend
from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "cuda")


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The attention backend for ``name`` (one of ``BACKEND_NAMES``) on ``device``."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                         f"got {name!r}")
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu" or (name == "auto" and device.type != "cuda"):
        return CpuAttentionBackend()
    if device.type != "cuda":
        raise ValueError("attention_backend='cuda' needs device='cuda'")
    try:
        from qworker.attention.cuda_backend import CudaAttentionBackend

        return CudaAttentionBackend()
    except Exception as exc:  # any import/compile failure: the reference still works
        if name == "cuda":
            raise
        logger.warning("CUDA attention backend unavailable (%s); using the torch reference", exc)
        return TorchAttentionBackend()
