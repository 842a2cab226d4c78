"""Compiled CUDA kernels, once per (source, template instantiation, device), and launching
them on torch's current stream.

cupy is imported on first use only, so this module imports on machines without it.
Kernels compile through ``cupy.RawModule`` (NVRTC, for the device's own architecture) with
the options of :mod:`qworker.attention.cuda_kernels`; cupy also keeps the cubin in its
on-disk cache, so a second process skips NVRTC. Arguments are passed as numpy scalars of the
exact C type (pointers as ``uint64``), so tensors travel zero-copy by ``data_ptr()``.

A launch is one ``cuLaunchKernel`` (cupy's driver binding) on the stream torch has current
at that moment, with the arguments packed into a reused buffer by ``struct``: no context
manager, no allocation, no host sync, so launches can be captured into CUDA graphs (the
driver copies the arguments when the launch is recorded).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from qworker.attention.cuda_kernels import NVRTC_OPTIONS, source

logger = logging.getLogger(__name__)


def import_cupy() -> Any:
    """The ``cupy`` module (cupy-cuda12x or -13x, whichever is installed)."""
    import cupy

    return cupy


def cupy_available() -> bool:
    """Whether cupy imports here (it still needs a driver to launch anything)."""
    return cupy_import_error() is None


def cupy_import_error() -> str | None:
    """Why cupy does not import here (``"ModuleNotFoundError: ..."``), or None when it does."""
    try:
        import_cupy()
    except Exception as exc:  # ImportError, or a broken CUDA library load
        return f"{type(exc).__name__}: {exc}"
    return None


def ptr(t: torch.Tensor | None) -> np.uint64:
    """A tensor's device address as a kernel pointer argument (null for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(x: int) -> np.int32:
    """An ``int`` kernel argument."""
    return np.int32(x)


def i64(x: int) -> np.int64:
    """A ``long long`` kernel argument."""
    return np.int64(x)


def f32(x: float) -> np.float32:
    """A ``float`` kernel argument."""
    return np.float32(x)


class KernelRunner(Protocol):
    """What the CUDA backend needs of a kernel runner: look a kernel up, launch it."""

    def get(self, source_name: str, name_expression: str, device: torch.device) -> Any:
        """A launchable handle for ``name_expression`` of ``cuda/<source_name>``."""
        ...

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        device: torch.device,
        shared_mem: int = 0,
    ) -> None:
        """Run ``kernel`` over ``grid`` with ``args`` (numpy scalars of the C types)."""
        ...


#: struct format of each kernel argument type, one 8-byte slot each.
_ARG_FORMAT: dict[type, str] = {np.uint64: "Q", np.int64: "q", np.int32: "i4x", np.float32: "f4x"}


class _ArgBuffer:
    """A reusable ``void*[]`` kernel-parameter array over one byte buffer (8 bytes per
    argument), for one argument signature."""

    def __init__(self, kinds: tuple[type, ...]) -> None:
        self.fmt = "<" + "".join(_ARG_FORMAT[k] for k in kinds)
        n = max(1, len(kinds))
        self.buf = ctypes.create_string_buffer(8 * n)
        base = ctypes.addressof(self.buf)
        self.ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.address = ctypes.addressof(self.ptrs)

    def pack(self, args: tuple[Any, ...]) -> int:
        """Write ``args`` into the buffer; the address of the pointer array."""
        struct.pack_into(self.fmt, self.buf, 0, *args)
        return self.address


@dataclass(slots=True)
class CompiledKernel:
    """A loaded kernel: cupy's object (kept alive), its CUfunction, its smem opt-in."""

    raw: Any
    func: int
    max_dynamic_smem: int = 0
    buffers: threading.local = field(default_factory=threading.local)


class KernelCache:
    """Compiled kernels keyed by (source file, name expression, device index).

    Thread-safe; compilation happens at the first request of a key and is logged with its
    duration.
    """

    def __init__(self) -> None:
        self._kernels: dict[tuple[str, str, int], CompiledKernel] = {}
        self._modules: list[Any] = []  # keeps each loaded module alive beside its kernel
        self._lock = threading.Lock()

    def get(self, source_name: str, name_expression: str, device: torch.device) -> Any:
        """The :class:`CompiledKernel` for ``name_expression`` in ``cuda/<source_name>``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (source_name, name_expression, index)
        kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                cupy = import_cupy()
                started = time.perf_counter()
                with cupy.cuda.Device(index):
                    module = cupy.RawModule(
                        code=source(source_name),
                        options=NVRTC_OPTIONS,
                        name_expressions=[name_expression],
                    )
                    raw = module.get_function(name_expression)
                    kernel = CompiledKernel(raw, int(raw.kernel.ptr))
                logger.info(
                    "compiled %s from %s for cuda:%d in %.2fs",
                    name_expression,
                    source_name,
                    index,
                    time.perf_counter() - started,
                )
                self._modules.append(module)
                self._kernels[key] = kernel
        return kernel

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        device: torch.device,
        shared_mem: int = 0,
    ) -> None:
        """Launch ``kernel`` on torch's current stream of ``device`` (read now, so a launch
        inside ``torch.cuda.graph`` lands in the capture)."""
        cupy = import_cupy()
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(index).cuda_stream
        if shared_mem > kernel.max_dynamic_smem:
            kernel.raw.max_dynamic_shared_size_bytes = shared_mem
            kernel.max_dynamic_smem = shared_mem
        kinds = tuple(type(a) for a in args)
        buf = getattr(kernel.buffers, "args", None)
        if buf is None or buf[0] != kinds:
            buf = (kinds, _ArgBuffer(kinds))
            kernel.buffers.args = buf
        params = buf[1].pack(args)
        launch = cupy.cuda.driver.launchKernel
        if index == torch.cuda.current_device():
            launch(kernel.func, *grid, *block, shared_mem, stream, params, 0)
        else:
            with cupy.cuda.Device(index):
                launch(kernel.func, *grid, *block, shared_mem, stream, params, 0)


#: The process-wide cache every backend instance shares.
KERNELS = KernelCache()


def _compile_group(group: list[tuple[str, str]]) -> int:
    for source_name, name in group:
        KERNELS.get(source_name, name, torch.device("cuda", 0))
    return len(group)


def precompile(names: list[tuple[str, str]], workers: int = 8) -> float:
    """Compile ``(source, name expression)`` pairs in ``workers`` processes (GPU 0), filling
    cupy's on-disk kernel cache so later processes load cubins instead of running NVRTC.

    Returns the seconds it took. Needs a CUDA device (NVRTC targets its architecture).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    started = time.perf_counter()
    groups = [names[i::workers] for i in range(workers) if names[i::workers]]
    context = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    with ProcessPoolExecutor(max_workers=len(groups), mp_context=context) as pool:
        sum(pool.map(_compile_group, groups))
    return time.perf_counter() - started
