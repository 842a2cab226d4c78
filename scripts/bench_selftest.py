"""The kernel self-test's margin and cost, side by side: sound kernels against planted faults.

For each shape, :func:`qworker.attention.selftest.select_attention` runs once with the sound
kernels and once per planted fault (``qworker.testing.kernel_faults``: the decode or prefill
kernel's softmax scale off by 2% or 5%, a cache write that never runs). Printed per row: the
component's worst relative error against the torch reference, the bound, ``err / bound``
(under 1 passes: the sound kernels' headroom, how far past the bound a fault lands), whether
the self-test fell back, the path it chose, and the seconds the whole selection took (the
engine's start-up cost at that shape, kernels already compiled). A table and one JSON line
(``--out`` writes it too); never asserts.

On a GPU the kernels are cupy's, at Llama-3.1-8B's attention shape (bf16 and FP8 KV) and an
fp16 GQA-7 shape with a sliding window. ``--dry-run`` runs the same sources through the CPU
emulator of ``tests/attention/emulator`` (needs g++) at small shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from qworker.attention.cuda_backend import CudaAttentionBackend
from qworker.attention.fp8 import FP8_DTYPE
from qworker.attention.selftest import SelftestShape, select_attention
from qworker.testing.kernel_faults import FaultyKernels

BF16, FP16 = torch.bfloat16, torch.float16
GPU_SHAPES = [
    ("8B bf16", SelftestShape(BF16, BF16, 128, 32, 8, 16, ((None, None),), 8192)),
    ("8B bf16, FP8 KV", SelftestShape(BF16, FP8_DTYPE, 128, 32, 8, 16, ((None, None),), 8192)),
    ("fp16 head 64 GQA 7, window 4096", SelftestShape(FP16, FP16, 64, 14, 2, 32,
                                                      ((None, None), (4096, None)), 8192)),
    ("Gemma-2-27B bf16, windows and soft-cap 50",
     SelftestShape(BF16, BF16, 128, 32, 16, 16, ((4096, 50.0), (None, 50.0)), 8192)),
]
DRY_SHAPES = [
    ("bf16 head 64 GQA 4", SelftestShape(BF16, BF16, 64, 4, 1, 16, ((None, None),), 512)),
    ("fp16 head 80 GQA 4, FP8 KV",
     SelftestShape(FP16, FP8_DTYPE, 80, 4, 1, 8, ((None, None),), 512)),
]
#: (label, component, kernel name prefix, fault, factor); None = the sound kernels.
FAULTS: list[tuple[str, str, str | None, str, float]] = [
    ("sound", "decode", None, "", 1.0),
    ("decode scale x1.02", "decode", "paged_decode_tc", "scale", 1.02),
    ("decode scale x1.05", "decode", "paged_decode_tc", "scale", 1.05),
    ("prefill scale x1.05", "prefill", "paged_prefill_tc", "scale", 1.05),
    ("cache write skipped", "cache_write", "reshape_and_cache", "skip", 1.0),
]


def runner_factory(dry: bool) -> Any:
    """A fresh base kernel runner: cupy's cache, or the CPU emulator."""
    if not dry:
        from qworker.attention.kernel_cache import KERNELS

        return lambda: KERNELS
    from tests.attention.conftest import EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL
    from tests.attention.emulator import EmulatedKernels, build

    lib = build(EMU_LEGACY, EMU_TC_DECODE, EMU_TC_PREFILL)
    return lambda: EmulatedKernels(lib)


def measure(label: str, shape: SelftestShape, fault: tuple[str, str, str | None, str, float],
            base: Any, device: torch.device, dry: bool) -> dict[str, Any]:
    """One selection with one fault planted; the row of the table."""
    name, component, prefix, kind, factor = fault
    if prefix is None:
        backend = CudaAttentionBackend(kernels=base(), num_sms=4) if dry else CudaAttentionBackend()
    else:
        backend = CudaAttentionBackend(kernels=FaultyKernels(base(), prefix, kind, factor),
                                       num_sms=4 if dry else None)
    if not dry:  # warm: kernels compiled (the emulator's are built once, up front)
        select_attention(backend, shape, device)
    started = time.perf_counter()
    sel = select_attention(backend, shape, device)
    seconds = time.perf_counter() - started
    first = [c for c in sel.checks if c.component == component]
    # the first path tried is the one the fault is in; its worst check
    tried = [c for c in first if c.path == first[0].path] if first else []
    worst = max(tried, key=lambda c: c.rel_err) if tried else None
    chosen = sel.backend.paths(shape.dtype, shape.kv_dtype, shape.head_dim, shape.num_q_heads,
                               shape.num_kv_heads, shape.block_size) \
        if hasattr(sel.backend, "paths") else {"decode": "torch"}
    err = worst.rel_err if worst else float("nan")
    finite = worst is not None and err != float("inf")
    return {"shape": label, "fault": name, "component": component,
            "rel_err": err if finite else None, "bound": worst.bound if worst else None,
            "err_over_bound": err / worst.bound if finite and worst else None,
            "fell_back": sel.fell_back, "caught": sel.fell_back == (prefix is not None),
            "path": chosen.get(component), "seconds": seconds, "checks": len(sel.checks)}


def main(argv: list[str] | None = None) -> int:
    """Run every shape x fault; print the table and the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the CPU emulator, small shapes")
    p.add_argument("--out", type=Path, help="write the JSON line here too")
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    base = runner_factory(dry)
    rows = [measure(label, shape, fault, base, device, dry)
            for label, shape in (DRY_SHAPES if dry else GPU_SHAPES) for fault in FAULTS]
    print(f"{'shape':<32} {'fault':<20} {'rel err':>9} {'bound':>7} {'err/bound':>9} "
          f"{'caught':>6} {'path':>12} {'s':>6}")
    for r in rows:
        err = "inf" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        ratio = "inf" if r["err_over_bound"] is None else f"{r['err_over_bound']:.2f}"
        print(f"{r['shape']:<32} {r['fault']:<20} {err:>9} {r['bound'] or 0:>7.0e} {ratio:>9} "
              f"{r['caught']!s:>6} {r['path']!s:>12} {r['seconds']:>6.2f}")
    report = {"device": torch.cuda.get_device_name() if not dry else "cpu (kernel emulator)",
              "rows": rows, "all_caught": all(r["caught"] for r in rows),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
