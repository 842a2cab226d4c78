"""Planted kernel faults for the kernel self-test (its tests on the CPU emulator, and
``scripts/bench_selftest.py`` on a GPU too): kernel runners that make chosen kernels compute
wrong numbers, so the engine's start-up check has something real to catch. They wrap any
runner with the ``get`` / ``launch`` interface (cupy's kernel cache, the emulator).

- :class:`RoutedKernels` sends the kernels whose name starts with a prefix to another runner,
  e.g. an emulator library built with ``QW_EMU_MUTATE_WAIT=1`` (the decode kernel's cp.async
  wait one group too weak: it reads stages still in flight, see cuda/paged_decode_tc.cu);
- :class:`FaultyKernels` launches the real kernel with every float argument scaled (the
  softmax scale of the attention kernels, the epsilon of the norms: plausible numbers, wrong
  ones) or does not launch it at all (its output stays whatever memory held).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class RoutedKernels:
    """A kernel runner: names starting with one of ``routes``' prefixes go to that runner,
    every other name to ``default``."""

    def __init__(self, default: Any, routes: dict[str, Any]) -> None:
        self.default = default
        self.routes = routes

    def _runner(self, name: str) -> Any:
        for prefix, runner in self.routes.items():
            if name.startswith(prefix):
                return runner
        return self.default

    def get(self, source_name: str, name_expression: str, device: torch.device) -> Any:
        """The handle of the runner serving ``name_expression``, remembered with it."""
        runner = self._runner(name_expression)
        return runner, runner.get(source_name, name_expression, device)

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[Any, ...], device: torch.device, shared_mem: int = 0) -> None:
        """Launch through the runner the handle came from."""
        runner, handle = kernel
        runner.launch(handle, grid, block, args, device, shared_mem=shared_mem)


class FaultyKernels:
    """``inner`` with a fault in the kernels whose name starts with ``prefix``: ``scale``
    multiplies their float arguments by ``factor``; ``skip`` drops their launches.
    ``hits`` counts the faulty launches."""

    def __init__(self, inner: Any, prefix: str, fault: str = "scale", factor: float = 1.25
                 ) -> None:
        if fault not in ("scale", "skip"):
            raise ValueError(f"fault must be 'scale' or 'skip', not {fault!r}")
        self.inner = inner
        self.prefix = prefix
        self.fault = fault
        self.factor = factor
        self.hits = 0

    def get(self, source_name: str, name_expression: str, device: torch.device) -> Any:
        """``inner``'s handle, with the name it was asked by."""
        return name_expression, self.inner.get(source_name, name_expression, device)

    def launch(self, kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
               args: tuple[Any, ...], device: torch.device, shared_mem: int = 0) -> None:
        """Launch, faulty for the chosen kernels."""
        name, handle = kernel
        if name.startswith(self.prefix):
            self.hits += 1
            if self.fault == "skip":
                return
            args = tuple(np.float32(a * self.factor) if isinstance(a, np.float32) else a
                         for a in args)
        self.inner.launch(handle, grid, block, args, device, shared_mem=shared_mem)
