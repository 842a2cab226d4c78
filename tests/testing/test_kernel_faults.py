"""The planted-fault kernel runners (qworker/testing/kernel_faults.py) over a recording stub."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from qworker.testing.kernel_faults import FaultyKernels, RoutedKernels

CPU = torch.device("cpu")


class Stub:
    """A runner that records what it was asked to launch."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.launched: list[tuple[Any, tuple[Any, ...]]] = []

    def get(self, source: str, name: str, device: torch.device) -> str:
        return f"{self.tag}:{name}"

    def launch(self, kernel: Any, grid: Any, block: Any, args: tuple[Any, ...],
               device: torch.device, shared_mem: int = 0) -> None:
        self.launched.append((kernel, args))


def test_scale_changes_only_float_arguments_of_matching_kernels() -> None:
    inner = Stub("a")
    faulty = FaultyKernels(inner, "paged_decode_tc", factor=2.0)
    args = (np.uint64(7), np.int32(3), np.float32(0.5))
    for name in ("paged_decode_tc<2, 0, 64, 1>", "reshape_and_cache<16>"):
        faulty.launch(faulty.get("x.cu", name, CPU), (1, 1, 1), (32, 1, 1), args, CPU)
    (k1, a1), (k2, a2) = inner.launched
    assert k2 == "a:reshape_and_cache<16>"
    assert k1 == "a:paged_decode_tc<2, 0, 64, 1>" and a1[2] == np.float32(1.0)
    assert a1[:2] == args[:2] and a2 == args and faulty.hits == 1


def test_skip_drops_the_launch_and_routes_pick_the_runner_by_prefix() -> None:
    inner = Stub("a")
    faulty = FaultyKernels(inner, "rms_norm", fault="skip")
    faulty.launch(faulty.get("f.cu", "rms_norm<2>", CPU), (1, 1, 1), (128, 1, 1), (), CPU)
    assert inner.launched == [] and faulty.hits == 1
    default, other = Stub("d"), Stub("o")
    routed = RoutedKernels(default, {"paged_decode_tc": other})
    for name in ("paged_decode_tc<1, 0, 32, 1>", "paged_prefill_tc<1, 0, 32>"):
        routed.launch(routed.get("x.cu", name, CPU), (1, 1, 1), (1, 1, 1), (), CPU)
    assert [k for k, _ in other.launched] == ["o:paged_decode_tc<1, 0, 32, 1>"]
    assert [k for k, _ in default.launched] == ["d:paged_prefill_tc<1, 0, 32>"]
    with pytest.raises(ValueError, match="fault"):
        FaultyKernels(inner, "x", fault="bitflip")
