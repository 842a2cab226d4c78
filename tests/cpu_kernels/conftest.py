"""A private build folder for the kernels these tests compile."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu_kernels")
