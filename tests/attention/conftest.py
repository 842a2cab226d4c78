"""The CPU emulator library shared by the attention tests: one g++ build holding every kernel
instantiation they launch (cached by content hash across sessions, see
``tests/attention/emulator``)."""

from __future__ import annotations

import pytest

# Legacy CUDA-core decode kernels: (dtype code, head dim, head tile).
EMU_LEGACY = [(0, 32, 8), (2, 64, 4), (1, 80, 2), (2, 128, 8), (0, 96, 1), (1, 32, 8)]
# ... and their soft-capped instantiations (a trailing 1) the soft-cap tests launch.
EMU_LEGACY += [(0, 32, 8, 1), (2, 64, 4, 1), (1, 80, 2, 1)]

# Tensor-core decode: (dtype code, kv8, head dim, NT).
EMU_TC_DECODE = [
    (2, 0, 64, 1), (1, 0, 80, 1), (2, 0, 128, 1), (2, 0, 32, 2), (1, 0, 96, 2), (2, 0, 256, 1),
    (2, 0, 64, 2), (1, 0, 32, 1), (2, 1, 64, 1), (1, 1, 80, 1), (2, 1, 112, 1), (2, 1, 256, 1),
    (1, 1, 32, 2),
    (2, 0, 64, 1, 1), (1, 0, 80, 1, 1), (2, 0, 256, 1, 1), (2, 1, 64, 1, 1), (1, 1, 80, 1, 1),
]  # fmt: skip

# Tensor-core prefill: (dtype code, kv8, head dim).
EMU_TC_PREFILL = [
    (2, 0, 64), (1, 0, 80), (2, 0, 128), (1, 0, 32), (2, 1, 64), (1, 1, 80), (2, 1, 112),
    (2, 0, 64, 1), (1, 0, 80, 1), (2, 1, 64, 1), (1, 1, 80, 1),
]  # fmt: skip


@pytest.fixture(scope="session")
def emu_lib():  # type: ignore[no-untyped-def]
    """The emulator library with every instance above (skips without a C++ compiler)."""
    from tests.attention.emulator import build, compiler

    if compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    return build(EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL)


@pytest.fixture(scope="session")
def emu_kernels(emu_lib):  # type: ignore[no-untyped-def]
    """A fresh :class:`~tests.attention.emulator.EmulatedKernels` factory."""
    from tests.attention.emulator import EmulatedKernels

    return lambda: EmulatedKernels(emu_lib)
