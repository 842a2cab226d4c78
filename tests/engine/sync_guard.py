"""A dispatch mode that fails on anything making the host wait for the device.

Inside ``no_host_sync()``: ``aten._local_scalar_dense`` (what ``.item()``, ``int()``,
``bool()`` and ``float()`` of a tensor run), a copy from a non-CPU tensor into CPU
memory, and ``Tensor.tolist`` / ``Tensor.numpy`` / ``Tensor.item`` raise
``HostSyncError``. With ``strict=True`` (used on a GPU), ops whose output size depends
on tensor values (``nonzero``, boolean-mask indexing) fail too: on a GPU they sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(AssertionError):
    """Raised on a device-to-host synchronisation inside ``no_host_sync``."""


_COPIES = {aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default,
                   aten._unique2.default}


class _Guard(TorchDispatchMode):
    def __init__(self, strict: bool) -> None:
        super().__init__()
        self.strict = strict
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops.append(str(func))
        if func is aten._local_scalar_dense.default:
            raise HostSyncError("a tensor value was read on the host (.item()/int()/bool())")
        if self.strict and func in _DATA_DEPENDENT:
            raise HostSyncError(f"{func}: output size depends on device data (a GPU sync)")
        if func is aten._to_copy.default:
            _check_copy(func, args[0], kwargs.get("device") or args[0].device)
        elif func in _COPIES:
            _check_copy(func, args[1], args[0].device)
        return func(*args, **kwargs)


def _check_copy(func: Any, src: Any, dst_device: Any) -> None:
    if (isinstance(src, torch.Tensor) and src.device.type != "cpu"
            and torch.device(dst_device).type == "cpu"):
        raise HostSyncError(f"{func}: device-to-host copy")


def _refuse(name: str) -> Any:
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise HostSyncError(f"Tensor.{name}() inside a step that must not sync")

    return method


@contextlib.contextmanager
def no_host_sync(strict: bool = False) -> Iterator[_Guard]:
    """Fail on any host-device synchronisation in the block (see the module docstring)."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "item")}
    guard = _Guard(strict)
    try:
        for name in saved:
            setattr(torch.Tensor, name, _refuse(name))
        with guard:
            yield guard
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
