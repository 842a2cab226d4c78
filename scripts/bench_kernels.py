"""Attention kernel microbenchmarks, ours beside the baselines in one run.

Prints tables and one JSON line (also written to ``--out``):

- ``copy``: device-to-device copy bandwidth (bytes read + written) of a large buffer: the
  ceiling decode is held against;
- ``decode``: per batch x context (Llama-3.1-8B attention: 32 query / 8 KV heads, head 128,
  bf16, block 16, blocks randomly placed), the tensor-core decode kernel (``kernel_ms``, CUDA
  events, median; its split plan; ``graph_ms``: the same launch replayed from a CUDA graph,
  without host work), the legacy CUDA-core kernel (``old_ms``), the FP8 cache
  (``fp8_ms``), torch SDPA on a contiguous cache (``sdpa_ms``), and the host time of one
  ``forward`` call (``host_us``); ratios: % of copy bandwidth, x SDPA, x old, FP8 / bf16;
- ``prefill``: chunks over cached contexts through the batched paged kernel vs gather +
  SDPA (bf16), the FP8 paged kernel, which is faster, and whether the backend's rule
  (``prefill_choice``) picks it.

``--dry-run`` runs every part on the CPU at toy sizes (host clock, the torch fallbacks),
only to prove the plumbing. Performance is never asserted.
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
from qworker.attention.cuda_kernels import prefill_choice
from qworker.attention.fp8 import FP8_MAX, quantize

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


def host_us(fn: Callable[[], Any], device: torch.device, calls: int = 50) -> float:
    """Host microseconds per call of ``fn`` issued back to back (no sync between calls)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return took / calls * 1e6


def graph_ms(fn: Callable[[], Any], device: torch.device, iters: int, per_graph: int = 10) -> float:
    """GPU milliseconds per ``fn`` replayed from a CUDA graph of ``per_graph`` calls."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    return time_ms(graph.replay, device, iters) / per_graph


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
    num_decodes = 0
    while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        num_seqs=len(seq_lens),
        num_tokens=starts[-1],
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        host_query_start_loc=starts,
        host_seq_lens=list(seq_lens),
    )
    return query, key_cache, value_cache, meta


def fp8_cache(
    kc: torch.Tensor, vc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache as FP8 with per-tensor scales (from its amax, as the first write would)."""
    scales = torch.stack([kc.abs().amax(), vc.abs().amax()]).float() * 2.0 / FP8_MAX
    return quantize(kc, scales[0]), quantize(vc, scales[1]), scales


def bench_decode(
    batch: int, ctx: int, dtype: torch.dtype, device: torch.device, iters: int
) -> dict[str, Any]:
    """One decode shape: new kernel (+ graph, + host), old kernel, FP8, SDPA contiguous."""
    query, kc, vc, meta = paged_batch([1] * batch, [ctx] * batch, dtype, device)
    scale = HEAD_DIM**-0.5
    elem = kc.element_size()
    nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * elem + 2 * batch * Q_HEADS * HEAD_DIM * elem
    row: dict[str, Any] = {"batch": batch, "ctx": ctx, "bytes": nbytes}
    new = CudaAttentionBackend()
    run_new = lambda: new.forward(query, kc, vc, meta, scale)  # noqa: E731
    row["kernel_ms"] = time_ms(run_new, device, iters)
    plan = new.last_decode
    if plan is None:  # the torch fallback (dry run on the CPU)
        row["plan"] = "torch"
    else:
        row["plan"] = f"split {plan.num_splits}x{plan.partition_size}" if plan.split else "whole"
    row["host_us"] = host_us(run_new, device)
    if device.type == "cuda":
        fixed = new.plan_decode(batch, ctx, Q_HEADS, KV_HEADS, HEAD_DIM, dtype, device=device)
        meta.decode_plan = fixed
        row["graph_ms"] = graph_ms(run_new, device, iters)
        meta.decode_plan = None
    old = CudaAttentionBackend(decode="legacy")
    row["old_ms"] = time_ms(lambda: old.forward(query, kc, vc, meta, scale), device, iters)
    k8, v8, scales = fp8_cache(kc, vc)
    kc = vc = None  # free the bf16 paged cache before the next allocations
    fp8 = CudaAttentionBackend()
    row["fp8_ms"] = time_ms(
        lambda: fp8.forward(query, k8, v8, meta, scale, kv_scales=scales), device, iters
    )
    k8 = v8 = meta = None
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
    row["new_vs_old"] = row["old_ms"] / row["kernel_ms"]
    row["fp8_vs_bf16"] = row["fp8_ms"] / row["kernel_ms"]
    if "sdpa_ms" in row:
        row["sdpa_gbps"] = nbytes / row["sdpa_ms"] / 1e6
        row["kernel_vs_sdpa"] = row["sdpa_ms"] / row["kernel_ms"]
    return row


def bench_prefill(
    chunk: int, ctx: int, seqs: int, dtype: torch.dtype, device: torch.device, iters: int
) -> dict[str, Any]:
    """``seqs`` chunks of ``chunk`` tokens ending ``ctx``-token contexts: the batched paged
    kernel vs gather + SDPA per sequence, and the paged kernel over an FP8 cache."""
    query, kc, vc, meta = paged_batch([chunk] * seqs, [ctx] * seqs, dtype, device, seed=1)
    row: dict[str, Any] = {"chunk": chunk, "ctx": ctx, "seqs": seqs}
    scale = HEAD_DIM**-0.5
    for mode in ("sdpa", "paged"):
        backend = CudaAttentionBackend(prefill=mode)
        row[f"{mode}_ms"] = time_ms(
            lambda b=backend: b.forward(query, kc, vc, meta, scale), device, iters
        )
    k8, v8, scales = fp8_cache(kc, vc)
    paged = CudaAttentionBackend(prefill="paged")
    row["fp8_paged_ms"] = time_ms(
        lambda: paged.forward(query, k8, v8, meta, scale, kv_scales=scales), device, iters
    )
    row["faster"] = "sdpa" if row["sdpa_ms"] <= row["paged_ms"] else "paged"
    row["rule"] = prefill_choice(seqs, chunk)
    row["rule_agrees"] = row["rule"] == row["faster"]
    return row


def main() -> None:
    """Run the benchmark and print the tables and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=1 << 21, help="skip batch*ctx above")
    args = parser.parse_args()

    if args.dry_run:
        device, dtype, iters = torch.device("cpu"), torch.bfloat16, 2
        batches, contexts, copy_bytes = [1, 4], [32, 64], 1 << 20
        prefill_shapes = [(8, 32, 1), (16, 64, 2)]
    else:
        device, dtype, iters = torch.device("cuda"), torch.bfloat16, args.iters
        batches, contexts, copy_bytes = [1, 8, 32, 64, 128, 256], [512, 2048, 8192, 32768], 4 << 30
        prefill_shapes = [(512, 512, 4), (512, 4096, 4), (2048, 8192, 1), (128, 16384, 4),
                          (8192, 8192, 1), (64, 2048, 32)]  # fmt: skip

    report: dict[str, Any] = {"device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    report["copy_gbps"] = copy_bandwidth(device, copy_bytes, iters)
    print(f"device-to-device copy: {report['copy_gbps']:.0f} GB/s (read + write)")

    rows = []
    print(f"{'batch':>5} {'ctx':>6} {'plan':>13} {'new ms':>8} {'graph':>7} {'host us':>7} "
          f"{'GB/s':>6} {'%copy':>6} {'old ms':>8} {'x old':>6} {'fp8 ms':>8} {'fp8/bf':>6} "
          f"{'sdpa ms':>8} {'x sdpa':>6}")  # fmt: skip
    for ctx in contexts:
        for batch in batches:
            if batch * ctx > args.max_tokens:
                continue
            row = bench_decode(batch, ctx, dtype, device, iters)
            row["pct_copy"] = 100 * row["kernel_gbps"] / report["copy_gbps"]
            rows.append(row)
            print(f"{batch:>5} {ctx:>6} {row['plan']:>13} {row['kernel_ms']:>8.3f} "
                  f"{row.get('graph_ms', math.nan):>7.3f} {row['host_us']:>7.1f} "
                  f"{row['kernel_gbps']:>6.0f} {row['pct_copy']:>6.1f} {row['old_ms']:>8.3f} "
                  f"{row['new_vs_old']:>6.2f} {row['fp8_ms']:>8.3f} {row['fp8_vs_bf16']:>6.2f} "
                  f"{row.get('sdpa_ms', math.nan):>8.3f} "
                  f"{row.get('kernel_vs_sdpa', math.nan):>6.2f}", flush=True)  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["decode"] = rows

    prefill = []
    print(f"{'chunk':>6} {'ctx':>6} {'seqs':>4} {'sdpa ms':>9} {'paged ms':>9} {'fp8 ms':>9} "
          f"faster rule")  # fmt: skip
    for chunk, ctx, seqs in prefill_shapes:
        row = bench_prefill(chunk, ctx, seqs, dtype, device, max(2, iters // 4))
        prefill.append(row)
        print(f"{chunk:>6} {ctx:>6} {seqs:>4} {row['sdpa_ms']:>9.3f} {row['paged_ms']:>9.3f} "
              f"{row['fp8_paged_ms']:>9.3f} {row['faster']:>6} {row['rule']}",
              flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["prefill"] = prefill
    report["prefill_rule_agrees"] = sum(r["rule_agrees"] for r in prefill)
    print(f"prefill rule agrees with the measurement on {report['prefill_rule_agrees']}/"
          f"{len(prefill)} shapes")  # fmt: skip
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
