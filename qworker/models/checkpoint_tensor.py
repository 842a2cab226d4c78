"""A checkpoint tensor not read yet, so a tensor-parallel rank reads only its slice.

``qworker.models.loader`` yields ``CheckpointTensor`` objects (safetensors' lazy
``get_slice``) instead of whole tensors when the model is sharded: a sharded layer
(``qworker.models.parallel_layers``) then reads the row or column range it owns, and a
rank's peak memory is about 1/N of the checkpoint (docs/operations.md, "Tensor
parallelism"). Everything else reads the whole tensor with ``read_all``. Functions
here take either form, so GGUF (whose loader yields whole, dequantized tensors) loads
the same way, sliced after the read.

A ``CheckpointTensor`` is valid only while the loader's iteration is at it (the file
handle stays open until the next tensor): read it before asking for the next one.
"""

from __future__ import annotations

from typing import Any

import torch


class CheckpointTensor:
    """One safetensors tensor, read on demand: whole, or a range of rows or columns."""

    __slots__ = ("_handle", "_name", "_slice", "dtype", "shape")

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape: tuple[int, ...] = tuple(self._slice.get_shape())
        self.dtype: torch.dtype | None = _DTYPES.get(self._slice.get_dtype())

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        if not self.shape:  # a scalar: slicing needs a dimension
            return self._handle.get_tensor(self._name)
        return self._slice[:]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the first dimension."""
        return self._slice[start:stop]

    def cols(self, start: int, stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` of the second dimension (all rows)."""
        return self._slice[:, start:stop]

    def narrow(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``[start, stop)`` of dimension ``dim`` (the rest whole)."""
        return self._slice[(slice(None),) * dim + (slice(start, stop),)]


class LazyTensor:
    """A tensor computed from a checkpoint tensor on read, slice by slice (an FP8 weight
    dequantized, or a dense one quantized on load: ``qworker.models.quant.prepare``):
    ``read_rows`` / ``read_cols`` / ``read_narrow`` / ``read_all`` take it like a
    ``CheckpointTensor``. Subclasses implement ``narrow``."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        return self.narrow(0, 0, self.shape[0])

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)``."""
        return self.narrow(0, start, stop)

    def cols(self, start: int, stop: int) -> torch.Tensor:
        """Columns ``[start, stop)`` (all rows)."""
        return self.narrow(1, start, stop)

    def narrow(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``[start, stop)`` of dimension ``dim``."""
        raise NotImplementedError


Readable = torch.Tensor | CheckpointTensor | LazyTensor

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E4M3FN": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_all(tensor: Readable) -> torch.Tensor:
    """``tensor`` as a torch tensor (reads a ``CheckpointTensor`` whole)."""
    return tensor.read() if isinstance(tensor, CheckpointTensor | LazyTensor) else tensor


def read_rows(tensor: Readable, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``tensor``'s first dimension, reading only those."""
    if isinstance(tensor, CheckpointTensor | LazyTensor):
        return tensor.rows(start, stop)
    return tensor[start:stop]


def read_cols(tensor: Readable, start: int, stop: int) -> torch.Tensor:
    """Columns ``[start, stop)`` of a 2-D ``tensor``, reading only those."""
    if isinstance(tensor, CheckpointTensor | LazyTensor):
        return tensor.cols(start, stop)
    return tensor[:, start:stop]


def read_narrow(tensor: Readable, dim: int, start: int, stop: int) -> torch.Tensor:
    """Indices ``[start, stop)`` of ``tensor``'s dimension ``dim``, reading only those
    (a stacked expert tensor ``[E, I, H]`` on I)."""
    if isinstance(tensor, CheckpointTensor | LazyTensor):
        return tensor.narrow(dim, start, stop)
    return tensor.narrow(dim, start, stop - start)
