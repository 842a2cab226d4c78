"""The kernels compile without a GPU: through NVRTC (the runtime's compiler, via cupy) and
through nvcc, for sm_90, with no register spills and no stack frame.

Compiling all instantiations the backend can request takes minutes on a shared 2-core
machine, so by default nvcc (CUDA 13, like the GPU machine's NVRTC) compiles every dtype x
head size at the largest head tile (the most registers) plus every head tile at head size
128 of the legacy kernel, and the tensor-core variants with the most registers
(``TC_NVCC_SAMPLE``); NVRTC a spread of those with the options and name expressions the
runtime passes to ``cupy.RawModule``. ``QWORKER_FULL_KERNEL_CHECK=1`` makes nvcc compile every
one (done for the current sources: no spills, no stack frame; registers in cuda/NOTES.md).
The tensor-core decode kernel must also stay within 128 registers for its 4-warp CTAs and
fit two CTAs per SM.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from qworker.attention import cuda_kernels as ck
from qworker.attention.nvrtc import KernelResources, compile_only, nvrtc_version, parse_ptxas_report

needs_nvrtc = pytest.mark.skipif(nvrtc_version() is None, reason="cupy / libnvrtc not installed")

#: Tensor-core variants compiled by default: the register-heaviest of each kind.
TC_NVCC_SAMPLE = {
    ck.DECODE_TC: [
        "paged_decode_tc<2, 0, 128, 1>",
        "paged_decode_tc<2, 0, 96, 2>",
        "paged_decode_tc<2, 0, 256, 1>",
        "paged_decode_tc<1, 1, 256, 1>",
        "paged_decode_tc<2, 0, 256, 1, 1>",  # soft-capped (Gemma 2)
    ],
    ck.PREFILL_TC: ["paged_prefill_tc<2, 0, 128>", "paged_prefill_tc<2, 0, 160>",
                    "paged_prefill_tc<2, 0, 160, 1>"],
}

NVRTC_TC_SAMPLE = {
    ck.DECODE_TC: ["paged_decode_tc<2, 0, 128, 1>", "paged_decode_tc<1, 1, 80, 2>"],
    ck.PREFILL_TC: ["paged_prefill_tc<2, 1, 64>", "paged_prefill_tc<2, 0, 128, 1>"],
}

NVRTC_DECODE_SAMPLE = [
    "paged_attention_decode<2, 128, 1>",
    "paged_attention_decode<2, 128, 8>",
    "paged_attention_decode<1, 80, 8>",
    "paged_attention_decode<0, 256, 8>",
    "paged_attention_decode<1, 96, 2>",
    "paged_attention_decode<0, 256, 8, 1>",
    "paged_attention_reduce<0>",
    "paged_attention_reduce<1>",
    "paged_attention_reduce<2>",
]


def _assert_no_local_memory(resources: dict[str, KernelResources], expected: int) -> None:
    assert len(resources) == expected, sorted(resources)
    bad = {
        k.name: (k.stack_frame, k.spill_stores, k.spill_loads)
        for k in resources.values()
        if k.stack_frame or k.spill_stores or k.spill_loads
    }
    assert not bad, f"stack frame / spills: {bad}"


def test_ptxas_report_parser_reads_spills_and_registers() -> None:
    log = (
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kv\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 64 registers, used 1 barriers\n"
    )
    (k,) = parse_ptxas_report(log).values()
    assert (k.name, k.registers, k.stack_frame, k.spill_stores, k.spill_loads) == (
        "_Z1kv",
        64,
        8,
        4,
        12,
    )


@needs_nvrtc
def test_cache_ops_compile_through_nvrtc_without_local_memory() -> None:
    names = ck.all_instantiations()[ck.CACHE_OPS]
    result = compile_only(ck.source(ck.CACHE_OPS), names)
    assert set(result.lowered) == set(names)
    assert result.cubin
    _assert_no_local_memory(result.resources, len(names))


@needs_nvrtc
def test_decode_and_reduce_compile_through_nvrtc_without_local_memory() -> None:
    every = set(ck.all_instantiations(soft_capped=True)[ck.PAGED_ATTENTION])
    assert set(NVRTC_DECODE_SAMPLE) <= every
    result = compile_only(ck.source(ck.PAGED_ATTENTION), NVRTC_DECODE_SAMPLE)
    assert result.cubin
    _assert_no_local_memory(result.resources, len(NVRTC_DECODE_SAMPLE))


@needs_nvrtc
@pytest.mark.parametrize("source", [ck.DECODE_TC, ck.PREFILL_TC])
def test_tensor_core_kernels_compile_through_nvrtc_without_local_memory(source: str) -> None:
    names = NVRTC_TC_SAMPLE[source]
    assert set(names) <= set(ck.all_instantiations(soft_capped=True)[source])
    result = compile_only(ck.source(source), names)
    assert result.cubin
    _assert_no_local_memory(result.resources, len(names))


@needs_nvrtc
def test_nvrtc_reports_a_broken_source_with_its_log() -> None:
    with pytest.raises(RuntimeError, match="error"):
        compile_only("__global__ void k() { undefined_thing(); }", ["k"])


def _nvcc_names(source: str, names: list[str]) -> list[str]:
    if os.environ.get("QWORKER_FULL_KERNEL_CHECK") == "1" or source == ck.CACHE_OPS:
        return names
    if source in TC_NVCC_SAMPLE:
        return [n for n in names if n in TC_NVCC_SAMPLE[source]]
    keep = set()
    for dtype in ck.DTYPE_CODE:
        keep.add(ck.reduce_name(dtype))
        for d in ck.HEAD_SIZES:
            keep.add(ck.decode_name(dtype, d, max(ck.HEAD_TILES)))
        keep.add(ck.decode_name(dtype, 256, max(ck.HEAD_TILES), capped=True))  # soft-capped
        for gt in ck.HEAD_TILES:
            keep.add(ck.decode_name(dtype, 128, gt))
    return [n for n in names if n in keep]


def _nvcc_translation_unit(source: str, names: list[str]) -> str:
    # Taking each instantiation's address makes nvcc emit it, as a launch would; the text is
    # the runtime's (headers inlined).
    refs = ",\n".join(f"  (void*)&{n}" for n in names)
    return f"{ck.source(source)}\nvoid* qw_instances[] = {{\n{refs}\n}};\n"


_TC_DECODE = re.compile(r"paged_decode_tcILi(\d)ELi(\d)ELi(\d+)ELi(\d)E")


def _assert_tc_decode_occupancy(resources: dict[str, KernelResources]) -> None:
    """4-warp decode CTAs: <= 128 registers; every variant: >= 2 CTAs per SM."""
    for k in resources.values():
        m = _TC_DECODE.search(k.name)
        if m is None:
            continue
        kv8, dim = int(m.group(2)), int(m.group(3))
        layout = ck.decode_tc_layout(bool(kv8), dim)
        if layout.warps == 4:
            assert k.registers <= 128, (k.name, k.registers)
        per_sm = ck.ctas_per_sm(layout.warps * 32, layout.smem_bytes, k.registers)
        assert per_sm >= 2, (k.name, k.registers, layout)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_every_instantiation_compiles_with_nvcc_sm90_without_spills() -> None:
    groups: list[tuple[str, list[str]]] = []
    for source, every in ck.all_instantiations(soft_capped=True).items():
        names = _nvcc_names(source, every)
        if source == ck.PAGED_ATTENTION:
            for code in ck.DTYPE_CODE.values():  # one nvcc per dtype, run side by side
                groups.append((source, [n for n in names if f"<{code}" in n]))
        elif len(names) > 8:  # the full check: split so the two cores share the work
            groups += [(source, names[i::4]) for i in range(4)]
        else:
            groups.append((source, names))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, (source, names) in enumerate(groups):
            unit = Path(tmp) / f"unit{i}.cu"
            unit.write_text(_nvcc_translation_unit(source, names))
            cmd = [
                "nvcc",
                "-std=c++17",
                "-arch=sm_90",
                "-Xptxas",
                "-v",
                "-c",
                str(unit),
                "-o",
                str(Path(tmp) / f"unit{i}.o"),
            ]
            procs.append(
                (
                    names,
                    subprocess.Popen(
                        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                    ),
                )
            )
        for names, proc in procs:
            log, _ = proc.communicate(timeout=1800)
            assert proc.returncode == 0, log[-4000:]
            report = parse_ptxas_report(log)
            _assert_no_local_memory(report, len(names))
            _assert_tc_decode_occupancy(report)
