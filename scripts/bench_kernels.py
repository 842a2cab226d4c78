"""Decode-kernel microbenchmark and the prefill choice, side by side in one run.

Prints a table and one JSON line (also written to ``--out``):

- ``copy``: device-to-device copy bandwidth (bytes read + written) of a large buffer: the
  ceiling the decode kernel is held against;
- ``decode``: for each batch x context (Llama-3-8B attention shape: 32 query heads, 8 KV
  heads, head 128, bf16, block 16, blocks randomly placed in the pool), the CUDA decode
  kernel's time (CUDA events, median) and achieved bandwidth (K/V bytes read plus q and out),
  with the split-K plan it chose, beside ``torch SDPA`` on a contiguous cache of the same
  shape; ratios to the copy bandwidth and to SDPA;
- ``prefill``: a prefill chunk over a cached context through gather + SDPA vs the paged
  decode kernel per token, and which is faster per shape.

``--dry-run`` runs every part on the CPU at toy sizes (timing with the host clock), only to
prove the plumbing. Performance is never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from qworker.attention.backend import AttentionMetadata
from qworker.attention.cuda_backend import CudaAttentionBackend

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, the host clock on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / ms / 1e6


def paged_batch(
    q_lens: list[int], seq_lens: list[int], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query, one layer's cache with each sequence's blocks randomly placed, metadata."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = [math.ceil(s / BLOCK) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    k = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[k : k + n]
        k += n
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    key_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    value_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.empty(starts[-1], Q_HEADS, HEAD_DIM, dtype=dtype, device=device).normal_()
    meta = AttentionMetadata(
        num_seqs=len(seq_lens),
        num_tokens=starts[-1],
        num_decodes=sum(1 for q in q_lens if q == 1) if all(q == 1 for q in q_lens) else 0,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return query, key_cache, value_cache, meta


def bench_decode(
    batch: int, ctx: int, dtype: torch.dtype, device: torch.device, iters: int
) -> dict[str, Any]:
    """One decode shape: the CUDA kernel (auto plan, and unsplit) vs SDPA on contiguous K/V."""
    query, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch, dtype, device)
    scale = HEAD_DIM**-0.5
    elem = kc.element_size()
    nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * elem + 2 * batch * Q_HEADS * HEAD_DIM * elem
    row: dict[str, Any] = {"batch": batch, "ctx": ctx, "bytes": nbytes}
    auto = CudaAttentionBackend()
    row["kernel_ms"] = time_ms(lambda: auto.forward(query, kc, vc, meta, scale), device, iters)
    plan = auto.last_decode
    row["plan"] = (
        f"split {plan.num_partitions}x{plan.partition_size}" if plan and plan.split else "whole"
    )
    if plan is not None and plan.split:
        whole = CudaAttentionBackend(split_k=False)
        row["unsplit_ms"] = time_ms(
            lambda: whole.forward(query, kc, vc, meta, scale), device, iters
        )
    kc = vc = meta = None  # free the paged cache before allocating the contiguous one
    k = torch.empty(batch, KV_HEADS, ctx, HEAD_DIM, dtype=dtype, device=device).normal_()
    v = torch.empty_like(k).normal_()
    q = query.view(batch, Q_HEADS, 1, HEAD_DIM)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    try:
        row["sdpa_ms"] = time_ms(sdpa, device, iters)
    except RuntimeError as exc:  # e.g. no GQA support in this torch build
        row["sdpa_error"] = str(exc)[:200]
    row["kernel_gbps"] = nbytes / row["kernel_ms"] / 1e6
    if "sdpa_ms" in row:
        row["sdpa_gbps"] = nbytes / row["sdpa_ms"] / 1e6
        row["kernel_vs_sdpa"] = row["sdpa_ms"] / row["kernel_ms"]
    return row


def bench_prefill(
    chunk: int, ctx: int, seqs: int, dtype: torch.dtype, device: torch.device, iters: int
) -> dict[str, Any]:
    """``seqs`` prefill chunks of ``chunk`` tokens ending a ``ctx``-token context: gather + SDPA
    vs the paged decode kernel per token."""
    query, kc, vc, meta = paged_batch([chunk] * seqs, [ctx] * seqs, dtype, device, seed=1)
    row: dict[str, Any] = {"chunk": chunk, "ctx": ctx, "seqs": seqs}
    for mode in ("sdpa", "paged"):
        backend = CudaAttentionBackend(prefill=mode)
        row[f"{mode}_ms"] = time_ms(
            lambda b=backend: b.forward(query, kc, vc, meta, HEAD_DIM**-0.5), device, iters
        )
    row["faster"] = "sdpa" if row["sdpa_ms"] <= row["paged_ms"] else "paged"
    return row


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=1 << 21, help="skip batch*ctx above")
    args = parser.parse_args()

    if args.dry_run:
        device, dtype, iters = torch.device("cpu"), torch.float32, 2
        batches, contexts, copy_bytes = [1, 4], [32, 64], 1 << 20
        prefill_shapes = [(8, 32, 1), (16, 64, 2)]
    else:
        device, dtype, iters = torch.device("cuda"), torch.bfloat16, args.iters
        batches, contexts, copy_bytes = [1, 8, 32, 64, 128, 256], [512, 2048, 8192, 32768], 4 << 30
        prefill_shapes = [(512, 512, 4), (512, 4096, 4), (2048, 8192, 1), (128, 16384, 4)]

    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["copy_gbps"] = copy_bandwidth(device, copy_bytes, iters)
    print(f"device-to-device copy: {report['copy_gbps']:.0f} GB/s (read + write)")

    rows = []
    header = (f"{'batch':>5} {'ctx':>6} {'plan':>14} {'kernel ms':>10} {'GB/s':>7} {'%copy':>6} "
              f"{'sdpa ms':>9} {'sdpa GB/s':>9} {'x sdpa':>7}")  # fmt: skip
    print(header)
    for ctx in contexts:
        for batch in batches:
            if batch * ctx > args.max_tokens:
                continue
            row = bench_decode(batch, ctx, dtype, device, iters)
            row["pct_copy"] = 100 * row["kernel_gbps"] / report["copy_gbps"]
            rows.append(row)
            print(f"{batch:>5} {ctx:>6} {row['plan']:>14} {row['kernel_ms']:>10.3f} "
                  f"{row['kernel_gbps']:>7.0f} {row['pct_copy']:>6.1f} "
                  f"{row.get('sdpa_ms', math.nan):>9.3f} {row.get('sdpa_gbps', math.nan):>9.0f} "
                  f"{row.get('kernel_vs_sdpa', math.nan):>7.2f}", flush=True)  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["decode"] = rows

    prefill = []
    print(f"{'chunk':>6} {'ctx':>6} {'seqs':>4} {'sdpa ms':>9} {'paged ms':>9} faster")
    for chunk, ctx, seqs in prefill_shapes:
        row = bench_prefill(chunk, ctx, seqs, dtype, device, max(2, iters // 4))
        prefill.append(row)
        print(f"{chunk:>6} {ctx:>6} {seqs:>4} {row['sdpa_ms']:>9.3f} {row['paged_ms']:>9.3f} "
              f"{row['faster']}", flush=True)  # fmt: skip
    report["prefill"] = prefill
    wins = sum(r["faster"] == "sdpa" for r in prefill)
    report["prefill_choice"] = "sdpa" if wins * 2 >= len(prefill) else "paged"
    print(f"prefill choice: {report['prefill_choice']} ({wins}/{len(prefill)} shapes favour sdpa)")
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
