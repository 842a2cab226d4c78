"""Which attention backend an engine gets for its ``attention_backend`` setting.

"auto" is the CUDA kernels on a GPU (the torch reference, with a warning, when they cannot
run there: no CuPy) and the batched CPU backend elsewhere; "torch" is always the reference,
"cpu" the batched backend, "cuda" the kernels (an error off a GPU or without CuPy). A
backend is only ever named for what it runs: ``stats().attention_backend`` says "cuda"
only when kernels launch. See docs/configuration.md.
"""

from __future__ import annotations

import logging

import torch

from qworker.attention.backend import AttentionBackend
from qworker.attention.cpu_backend import CpuAttentionBackend
from qworker.attention.kernel_cache import KernelRunner, cupy_import_error
from qworker.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "cuda")

#: Multiprocessors an injected (emulated) kernel runner plans launches for.
EMULATED_SMS = 4


def select_backend(name: str, device: torch.device,
                   kernels: KernelRunner | None = None) -> AttentionBackend:
    """The attention backend for ``name`` (one of ``BACKEND_NAMES``) on ``device``.

    ``kernels`` (tests) replaces the cupy kernel runner with another one, the CPU emulator of
    ``tests/attention/emulator``: "auto" and "cuda" then give the CUDA backend on any device.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                         f"got {name!r}")
    if name == "torch":
        return TorchAttentionBackend()
    from qworker.attention.cuda_backend import CudaAttentionBackend

    if kernels is not None and name in ("auto", "cuda"):
        return CudaAttentionBackend(kernels=kernels, num_sms=EMULATED_SMS)
    if name == "cpu" or (name == "auto" and device.type != "cuda"):
        return CpuAttentionBackend()
    if device.type != "cuda":
        raise ValueError("attention_backend='cuda' needs device='cuda'")
    missing = cupy_import_error()
    if missing is not None:
        if name == "cuda":
            raise ValueError(f"attention_backend='cuda' needs CuPy to launch its kernels, "
                             f"which does not import here ({missing})")
        logger.warning("CUDA attention kernels unavailable (CuPy does not import: %s); "
                       "attention runs the torch reference", missing)
        return TorchAttentionBackend()
    return CudaAttentionBackend()
