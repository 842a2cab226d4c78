"""Building and loading the CPU kernels: cached builds, and torch's ops without a compiler."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from qworker import cpu_kernels


def test_a_second_load_reuses_the_cached_build(tmp_path: Path) -> None:
    first = cpu_kernels.load(tmp_path)
    if first is None:
        pytest.skip("no C compiler here (covered by the test below)")
    cpu_kernels._loaded.pop((tmp_path, "native"))
    again = cpu_kernels.load(tmp_path)
    assert again is not None and again.path == first.path
    assert again.panel_width % 4 == 0


def test_no_compiler_means_torch_ops_and_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="qworker.cpu_kernels"):
        assert cpu_kernels.load(tmp_path / "none") is None
        assert cpu_kernels.load(tmp_path / "none") is None  # remembered, not retried
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1
    assert "no C compiler" in warnings[0].getMessage()


def test_a_failing_build_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_FLAGS", (*cpu_kernels._FLAGS, "-Wl,--no-such-flag"))
    with caplog.at_level(logging.WARNING, logger="qworker.cpu_kernels"):
        assert cpu_kernels.load(tmp_path / "broken") is None
    assert any("failed" in r.getMessage() for r in caplog.records)
