"""Host arrays to the device without waiting for it.

A plain ``tensor.to("cuda")`` from pageable memory makes the host wait for the stream,
i.e. for the forward just launched; the sampler's small per-step arrays go through
pinned memory with ``non_blocking`` instead (the caching host allocator keeps each
pinned buffer alive until its copy ran). On CPU the array is used in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence[int] | Sequence[float], device: torch.device,
              dtype: np.dtype | type | None = None) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (``dtype``: a numpy dtype to convert to)."""
    array = np.ascontiguousarray(values, dtype=dtype)
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
