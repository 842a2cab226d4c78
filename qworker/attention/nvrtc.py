"""Compile a kernel source with NVRTC without a GPU, and read ptxas' resource report.

The runtime compiles through ``cupy.RawModule``, which calls NVRTC with the backend's
options plus the device's ``-arch``. Here the same library is driven directly
(``cupy.cuda.nvrtc``) with an explicit ``-arch``, so CI machines without a driver can prove
that every instantiation compiles, and that none spills registers or needs a stack frame.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qworker.attention.cuda_kernels import NVRTC_OPTIONS

#: What ``cupy.RawModule`` adds to the caller's options before calling NVRTC (cupy 13/14).
CUPY_ADDED_OPTIONS: tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGS = re.compile(r"Used (\d+) registers")


@dataclass(slots=True)
class KernelResources:
    """ptxas' report for one compiled entry point."""

    name: str
    registers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass(slots=True)
class CompileResult:
    """What one compile produced: the cubin, lowered names and ptxas' report per kernel."""

    cubin: bytes
    lowered: dict[str, str]
    resources: dict[str, KernelResources]
    log: str


def parse_ptxas_report(log: str) -> dict[str, KernelResources]:
    """Per mangled kernel name, the registers / stack frame / spills of a ``-v`` report
    (the format nvcc ``-Xptxas -v`` and NVRTC ``--ptxas-options=-v`` share)."""
    out: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = out.setdefault(m.group(1), KernelResources(m.group(1)))
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _REGS.search(line)
        if m:
            current.registers = int(m.group(1))
    return out


def nvrtc_version() -> tuple[int, int] | None:
    """The NVRTC version cupy loads, or None when cupy or libnvrtc is missing."""
    try:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
    except Exception:  # ImportError, or the library failing to load
        return None
    return int(major), int(minor)


def compile_only(
    code: str, name_expressions: list[str], arch: str = "sm_90", filename: str = "kernel.cu"
) -> CompileResult:
    """Compile ``code`` for ``arch`` with the runtime's options and a resource report.

    Raises ``RuntimeError`` carrying NVRTC's log when compilation fails.
    """
    from cupy.cuda import nvrtc

    options = (*NVRTC_OPTIONS, *CUPY_ADDED_OPTIONS, f"-arch={arch}", "--ptxas-options=-v")
    prog = nvrtc.createProgram(code, filename, (), ())
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
        log = nvrtc.getProgramLog(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in name_expressions}
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return CompileResult(cubin, lowered, parse_ptxas_report(log), log)
