"""The packed CPU matmul (``qworker.models.cpu_gemm``) against ``F.linear``, side by side.

For each linear layer shape of SmolLM2-135M (``make run``'s model: hidden 576, 9 query
and 3 KV heads of 64, MLP 1536, vocabulary 49152) and each row count (a decode step of
``make run``'s 9 sequences, and its 329-token prefill), times ``F.linear`` on torch's
threads and the packed kernel on its pool's, alternating, best of ``--repeats``; prints
a table, the ratio over the whole step's matmuls (the LM head only at the first row
count, the sequences: logits are computed for one row each), and one JSON line. Random fp32
weights; never asserts on speed.

    python scripts/bench_cpu_gemm.py [--threads N] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qworker import cpu_kernels
from qworker.engine.engine_setup import available_cores, default_cpu_threads
from qworker.models import cpu_gemm

# (name, out_features, in_features, per step: layers using it)
SHAPES = [("qkv", 960, 576, 30), ("o_proj", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 1)]


def best_of(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Run the comparison (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both sides (default: the engine's defaults)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rows", type=int, nargs="+", default=[9, 329])
    args = p.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        sys.exit("the CPU kernels cannot be built here (no C compiler?)")
    torch.set_num_threads(args.threads or default_cpu_threads())
    kernels.set_threads(args.threads or available_cores())
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, packed-kernel threads {kernels.threads}")
    print(f"{'layer':<10}{'rows':>6}{'F.linear ms':>14}{'packed ms':>12}{'ratio':>8}")
    result: dict[str, object] = {"bench": "cpu_gemm", "torch_threads": torch.get_num_threads(),
                                 "kernel_threads": kernels.threads}
    for m in args.rows:
        step_torch = step_packed = 0.0
        for name, n, k, count in SHAPES:
            if name == "lm_head" and m != args.rows[0]:
                continue  # logits are computed for one row per sequence only
            w = torch.randn(n, k) / k**0.5
            x = torch.randn(m, k)
            packed = cpu_gemm.pack(kernels, w)
            t_torch = t_packed = float("inf")
            for _ in range(2):  # alternate the two
                t_torch = min(t_torch, best_of(lambda x=x, w=w: F.linear(x, w), args.repeats))
                t_packed = min(t_packed, best_of(lambda x=x, pw=packed: pw.linear(x), args.repeats))
            torch.testing.assert_close(packed.linear(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
            step_torch += t_torch * count
            step_packed += t_packed * count
            print(f"{name:<10}{m:>6}{t_torch * 1e3:>14.3f}{t_packed * 1e3:>12.3f}"
                  f"{t_torch / t_packed:>7.2f}x")
        print(f"{'step':<10}{m:>6}{step_torch * 1e3:>14.2f}{step_packed * 1e3:>12.2f}"
              f"{step_torch / step_packed:>7.2f}x")
        result[f"rows_{m}"] = {"f_linear_ms": round(step_torch * 1e3, 3),
                               "packed_ms": round(step_packed * 1e3, 3),
                               "ratio": round(step_torch / step_packed, 3)}
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
