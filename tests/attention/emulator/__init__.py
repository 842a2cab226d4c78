"""Run the kernels of ``cuda/`` on the CPU: a g++ build of the same sources with a thin CUDA
shim (``cuda_emu.h``), launched through the backend's own argument packing.

``EmulatedKernels`` has the backend's kernel-runner interface (``get`` / ``launch``), so
``CudaAttentionBackend(kernels=EmulatedKernels(...))`` runs its real launch code, on CPU
tensors, against kernels compiled from the real sources. Slow (one OS thread per GPU
thread), so tests keep shapes small.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qworker.attention.cuda_kernels import CUDA_DIR

HERE = Path(__file__).resolve().parent


def compiler() -> str | None:
    """The C++ compiler used for the emulator, or None when there is none."""
    return shutil.which("g++")


def build(
    decode_instances: list[tuple[int, ...]] = (),  # type: ignore[assignment]
    tc_decode: list[tuple[int, ...]] = (),  # type: ignore[assignment]
    tc_prefill: list[tuple[int, ...]] = (),  # type: ignore[assignment]
    defines: list[str] = (),  # type: ignore[assignment]
) -> ctypes.CDLL:
    """Compile the emulator with these kernels (cached by content hash in the temp dir) and
    load it: legacy decode ``(dtype code, head dim, head tile)``, tensor-core decode
    ``(dtype code, kv8, head dim, NT)`` and tensor-core prefill ``(dtype code, kv8, head
    dim)``, each with an optional trailing 1 for its soft-capped instantiation (``CAP``).
    The cache ops and the self-test kernels are always in. ``defines`` are extra ``-D``
    macros (tests build deliberately broken variants with them)."""

    def lines(macro: str, instances: list[tuple[int, ...]], arity: int) -> str:
        out = ""
        for inst in instances:
            capped = len(inst) > arity and inst[arity]
            args = ", ".join(str(v) for v in inst[:arity])
            out += f"{macro}{'_CAP' if capped else ''}({args})\n"
        return out

    inc = lines("QW_DECODE", decode_instances, 3)
    inc += lines("QW_DECODE_TC", tc_decode, 4)
    inc += lines("QW_PREFILL_TC", tc_prefill, 3)
    digest = hashlib.sha256((inc + "|".join(defines)).encode())
    for path in (
        HERE / "cuda_emu.h",
        HERE / "emu_kernels.cpp",
        HERE / "selftest.cpp",
        *sorted(CUDA_DIR.glob("*.cu")),
        *sorted(CUDA_DIR.glob("*.cuh")),
    ):
        digest.update(path.read_bytes())
    out_dir = Path(tempfile.gettempdir()) / f"qworker_emu_{digest.hexdigest()[:16]}"
    lib = out_dir / "libqwemu.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "emu_instances.inc").write_text(inc)
        tmp = out_dir / f"libqwemu.{id(inc)}.so"
        cmd = [
            compiler() or "g++",
            "-std=c++20",
            "-O1",
            "-g0",
            "-shared",
            "-fPIC",
            "-pthread",
            "-Wno-unknown-pragmas",
            *[f"-D{d}" for d in defines],
            "-x",
            "c++",
            str(HERE / "emu_kernels.cpp"),
            f"-I{HERE}",
            f"-I{CUDA_DIR}",
            f"-I{out_dir}",
            "-o",
            str(tmp),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"emulator build failed:\n{done.stderr[-6000:]}")
        tmp.replace(lib)
    dll = ctypes.CDLL(str(lib))
    dll.qw_emu_run.restype = ctypes.c_int
    return dll


class EmulatedKernels:
    """The backend's kernel runner, executing on the CPU through the emulator library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self.launches: list[str] = []

    def get(self, source_name: str, name_expression: str, device: torch.device) -> str:
        """The kernel's name expression (the library dispatches on it)."""
        return name_expression

    def launch(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        device: torch.device,
        shared_mem: int = 0,
    ) -> None:
        """Run the kernel to completion; raise if the emulator refuses the arguments."""
        boxes = [np.array(a) for a in args]
        for a, box in zip(args, boxes, strict=True):
            if not isinstance(a, np.generic):
                raise TypeError(f"kernel argument {a!r} is not a numpy scalar")
            assert box.dtype == a.dtype
        n = len(boxes)
        ptrs = (ctypes.c_void_p * n)(*[b.ctypes.data for b in boxes])
        sizes = (ctypes.c_int * n)(*[b.itemsize for b in boxes])
        rc = self._lib.qw_emu_run(
            str(kernel).encode(),
            ctypes.c_uint(grid[0]),
            ctypes.c_uint(grid[1]),
            ctypes.c_uint(grid[2]),
            ctypes.c_uint(block[0]),
            ctypes.c_ulonglong(shared_mem),
            ctypes.c_int(n),
            ptrs,
            sizes,
        )
        if rc != 0:
            raise RuntimeError(f"emulated launch of {kernel} failed ({rc})")
        self.launches.append(str(kernel))
