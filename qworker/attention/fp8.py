"""FP8 E4M3 KV cache: per-layer scales, quantization, and finding a layer's scales.

``kv_cache_dtype="fp8_e4m3"`` (docs/configuration.md) stores keys and values as
``torch.float8_e4m3fn``, one byte per element, with one fp32 scale per layer for K and
one for V (per-tensor scaling): a cache write stores ``e4m3(x / scale)`` (round to nearest
even, saturating at +-448), a read is ``stored * scale``.

A layer's scales are set by its first cache write with real tokens:
``scale = amax(x) * HEADROOM / 448`` over those tokens (one host read per layer, once), then
fixed, since every stored byte depends on them. ``HEADROOM`` lets later values grow to
twice the first write's largest magnitude before they saturate; e4m3 keeps about 2^-4
relative precision over 2^15 of range below that. The first real write of a layer is the
engine's first prefill (a pool reallocated after profiling starts uncalibrated again).

The scales live next to the pool (``KVCache.scales``, a ``[num_layers, 2]`` fp32 tensor
on the pool's device: ``{k_scale, v_scale}`` per layer, the layout the kernels read
through one pointer). Backends receive one layer's cache tensors, not the pool, so
:func:`layer_scales` finds the pool and layer of a layer view by its address: models need
no extra argument. Callers that hold the scales may pass them explicitly instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

#: Storage dtype of an FP8 KV cache.
FP8_DTYPE = torch.float8_e4m3fn

#: Largest finite E4M3 magnitude.
FP8_MAX = 448.0

#: How far above the first write's largest magnitude values may grow before saturating.
HEADROOM = 2.0

#: Smallest amax calibration accepts (an all-zero first write must not give scale 0).
MIN_AMAX = 1e-6

#: ``kv_cache_dtype`` values (docs/configuration.md).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``kv_cache_dtype`` ("auto" = the model dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is the FP8 cache storage type."""
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` as E4M3, round to nearest even, saturating at +-448 (the reference
    every cache-write kernel is compared with byte for byte)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x8: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Stored E4M3 values times ``scale``, in ``dtype`` (computed in fp32)."""
    return (x8.float() * scale).to(dtype)


@dataclass(slots=True)
class KVScales:
    """Per-layer K and V scales of one FP8 pool, and which layers are calibrated."""

    values: torch.Tensor  # fp32 [num_layers, 2]: {k_scale, v_scale}
    calibrated: list[bool] = field(default_factory=list)

    @classmethod
    def allocate(cls, num_layers: int, device: torch.device | str) -> KVScales:
        """Uncalibrated scales (zeros) for ``num_layers`` layers on ``device``."""
        values = torch.zeros(num_layers, 2, dtype=torch.float32, device=device)
        return cls(values, [False] * num_layers)

    def calibrate(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Set ``layer``'s scales from this write's real rows (slot >= 0), once.

        A write with no real row (a CUDA-graph warm-up of padding) leaves the layer
        uncalibrated, and so does one made during graph capture (the check reads one value
        back): captured kernels read the scales from device memory at replay, and decode
        steps only follow a sequence's (eager) prefill, which calibrates first.
        """
        if self.calibrated[layer]:
            return
        if key.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        keep = (slot_mapping >= 0).to(key.device)
        if not bool(keep.any()):
            return
        keep = keep.view(-1, *([1] * (key.dim() - 1)))
        amax = torch.stack([(key.float().abs() * keep).amax(), (value.float().abs() * keep).amax()])
        self.values[layer].copy_(amax.clamp_min(MIN_AMAX) * (HEADROOM / FP8_MAX))
        self.calibrated[layer] = True


# Pools whose layer views layer_scales() can resolve: (weak ref to the pool's key tensor,
# its scales). Weak, so a dropped pool is forgotten.
_POOLS: list[tuple[weakref.ref[torch.Tensor], KVScales]] = []


def register_pool(key_pool: torch.Tensor, scales: KVScales) -> None:
    """Make ``key_pool`` ([num_layers, ...]) findable from any of its layer views."""
    _POOLS[:] = [(ref, s) for ref, s in _POOLS if ref() is not None]
    _POOLS.append((weakref.ref(key_pool), scales))


def layer_scales(key_cache: torch.Tensor) -> tuple[KVScales, int] | None:
    """The scales and layer index of ``key_cache`` (one layer of a registered pool)."""
    ptr = key_cache.data_ptr()
    for ref, scales in _POOLS:
        pool = ref()
        if pool is None or pool.device != key_cache.device or pool.dim() != key_cache.dim() + 1:
            continue
        stride = pool.stride(0) * pool.element_size()
        offset = ptr - pool.data_ptr()
        if 0 <= offset < pool.shape[0] * stride and offset % stride == 0:
            return scales, offset // stride
    return None


def resolve_scales(
    key_cache: torch.Tensor, kv_scales: torch.Tensor | None
) -> tuple[torch.Tensor, KVScales | None, int]:
    """One layer's ``{k_scale, v_scale}`` tensor for an FP8 cache: ``kv_scales`` when given,
    else looked up from the registered pool (with the pool's scales and layer, for
    calibration). Raises ``ValueError`` when neither is available."""
    if kv_scales is not None:
        return kv_scales.reshape(2), None, -1
    found = layer_scales(key_cache)
    if found is None:
        raise ValueError(
            "FP8 KV cache without scales: allocate the pool with KVCache.allocate "
            "(kv_cache_dtype fp8_e4m3) or pass kv_scales"
        )
    scales, layer = found
    return scales.values[layer], scales, layer
