"""Apply token bitmasks to a batch of logits on their device, all rows at once.

A bitmask row holds one bit per token id (bit ``t % 32`` of int32 word ``t // 32``, as
llguidance writes it); a cleared bit sets that token's logit to ``-inf``. On CPU the
bits are unpacked by numpy; on a GPU the packed words travel (32x less than a bool
mask) and are unpacked there.
"""

from __future__ import annotations

import numpy as np
import torch

from qworker.cpu_kernels import CpuKernels
from qworker.engine.device_copy import to_device

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_allowed(words: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bool ``[n, vocab_size]`` on ``device``: True where the token is allowed.

    ``words`` is a CPU int32 ``[n, ceil(vocab/32)]`` tensor (pinned for a GPU).
    """
    if device.type == "cpu":
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    w = words.to(device, non_blocking=True)
    return ((w.unsqueeze(-1) >> shifts) & 1).view(w.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: np.ndarray,
                        allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``-inf`` wherever row ``rows[i]``'s ``allowed[i]`` is False.

    ``rows`` holds distinct row indices (host array); ``allowed`` is on the logits'
    device. One ``torch.where`` over the batch; ``logits`` itself is left untouched.
    """
    num_rows = logits.shape[0]
    if len(rows) != num_rows or not bool((rows == np.arange(num_rows)).all()):
        full = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        full.index_copy_(0, to_device(rows, logits.device, np.int64), allowed)
        allowed = full
    return torch.where(allowed, logits, float("-inf"))


def masked_argmax_cpu(kernels: CpuKernels, logits: torch.Tensor, rows: np.ndarray,
                      index: np.ndarray, words: torch.Tensor) -> torch.Tensor:
    """``apply_token_bitmask(logits, rows, allowed).argmax(-1)`` in one pass on the CPU.

    Row ``rows[i]`` of fp32 ``logits`` may choose the tokens of mask row ``words[index[i]]``;
    other rows choose among all tokens. Same result as the two-step form, ties and NaN
    included (``qworker/cpu_kernels/token_mask.c``), without writing a masked copy.
    """
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    w = words if words.is_contiguous() else words.contiguous()
    word_row = np.full(x.shape[0], -1, dtype=np.int64)
    word_row[rows] = index
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernels.lib.qw_masked_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                 w.data_ptr(), w.shape[1], word_row.ctypes.data, out.data_ptr())
    return out
