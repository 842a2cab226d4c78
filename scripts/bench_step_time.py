"""Decode step time on a model's shape: CUDA graphs on vs off, beside the weight-read bound.

Builds the engine with random weights made on the device (``load_format="dummy"``: only a
config.json is written, default the Llama-3.1-8B shape in bf16), then for each batch size
(default 1, 32, 256) queues that many requests of ``--context`` prompt tokens, prefills
them, and times ``--steps`` pure-decode steps twice: replaying the decode CUDA graphs, and
eagerly (graphs set aside). The lower bound beside each figure is the time to read the
weights once plus the step's KV cache at the device's measured copy bandwidth (a
device-to-device copy of 1 GiB in the same run). With ``--trace DIR`` one decode step at
the middle batch size is recorded with the torch profiler (``decode_step_trace.json.gz``,
a Chrome trace).

``--dry-run`` runs a tiny Llama on the CPU (eager only) to prove the plumbing. Prints a
table and one JSON line (``--out`` writes it too). Never asserts on speed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.sampling_params import SamplingParams

LLAMA_31_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
}
TINY: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}


def write_config(folder: Path, shape: dict[str, Any], dtype: str) -> Path:
    """A Llama config.json only (the weights are made on the device at load)."""
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, tie_word_embeddings=False, torch_dtype=dtype,
                         bos_token_id=1, eos_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(folder))
    return folder


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in bytes/s (read + write of 1 GiB); None off a GPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * 5 * src.numel() / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    """Wait for the device so that timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_ms(engine: Engine, steps: int) -> float:
    """Mean wall time of ``steps`` engine steps (every running request decodes)."""
    device = engine.runner.device
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def measure_batch(engine: Engine, batch: int, args: argparse.Namespace, vocab: int,
                  trace_dir: Path | None) -> dict[str, Any]:
    """Prefill ``batch`` requests, then time graph replays and eager decode steps."""
    rng = random.Random(batch)
    total = args.warmup + 2 * args.steps + 8
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(3, vocab) for _ in
                                             range(args.context)], params)
    while engine.stats().num_requests_waiting or any(
            s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()  # prefill (chunked by max_num_batched_tokens)
    for _ in range(args.warmup):
        engine.step()
    runner = engine.runner
    row: dict[str, Any] = {"batch": batch, "context": args.context}
    row["graphs_ms"] = decode_ms(engine, args.steps) if runner.graphs is not None else None
    graphs, runner.graphs = runner.graphs, None
    try:
        row["eager_ms"] = decode_ms(engine, args.steps)
        if trace_dir is not None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if runner.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            runner.graphs = graphs  # trace what production runs
            with profile(activities=activities) as prof:
                engine.step()
                sync(runner.device)
            trace_dir.mkdir(parents=True, exist_ok=True)
            raw = trace_dir / "decode_step_trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
    finally:
        runner.graphs = graphs
    for rid in [f"b{batch}-{i}" for i in range(batch)]:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return row


def lower_bound_ms(shape: dict[str, Any], batch: int, context: int, elem: int,
                   weight_bytes: int, bandwidth: float | None) -> float | None:
    """Weights read once plus the step's K/V read, at ``bandwidth`` bytes/s."""
    if bandwidth is None:
        return None
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = (2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * elem
          * batch * context)
    return 1e3 * (weight_bytes + kv) / bandwidth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,256", help="batch sizes (default 1,32,256)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before timing")
    p.add_argument("--trace", type=Path, default=None, help="write a profiler trace here")
    p.add_argument("--out", type=Path, default=None, help="write the JSON line here too")
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    shape, dtype, device = LLAMA_31_8B, "bfloat16", "cuda"
    if args.dry_run:
        shape, dtype, device = TINY, "float32", "cpu"
        batches = [min(b, 8) for b in batches]
        args.context, args.steps, args.warmup = min(args.context, 32), min(args.steps, 4), 1
    folder = write_config(Path(tempfile.mkdtemp(prefix="qworker_shape_")), shape, dtype)
    started = time.perf_counter()
    engine = Engine(EngineConfig(
        model=str(folder), load_format="dummy", dtype=dtype, device=device,
        max_num_seqs=max(batches), max_model_len=args.context + 2 * args.steps + args.warmup + 64,
        enable_prefix_caching=False, max_num_batched_tokens=8192,
        kv_cache_memory=(64 << 20) if args.dry_run else None))
    startup = time.perf_counter() - started
    dev = engine.runner.device
    bandwidth = copy_bandwidth(dev)
    params = engine.runner.model.parameters()
    elem = torch.empty((), dtype=engine.spec.dtype).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    rows = []
    for i, batch in enumerate(batches):
        trace = args.trace if args.trace is not None and i == len(batches) // 2 else None
        row = measure_batch(engine, batch, args, shape["vocab_size"], trace)
        row["bound_ms"] = lower_bound_ms(shape, batch, args.context, elem, weight_bytes,
                                         bandwidth)
        best = row["graphs_ms"] if row["graphs_ms"] is not None else row["eager_ms"]
        row["x_bound"] = best / row["bound_ms"] if row["bound_ms"] else None
        row["output_tok_s"] = 1e3 * batch / best
        rows.append(row)
    print(f"{'batch':>5} {'graphs ms':>10} {'eager ms':>9} {'bound ms':>9} {'x bound':>8} "
          f"{'tok/s':>9}")
    for r in rows:
        g = f"{r['graphs_ms']:.2f}" if r["graphs_ms"] is not None else "-"
        xb = f"{r['x_bound']:.2f}" if r["x_bound"] is not None else "-"
        bound = f"{r['bound_ms']:.2f}" if r["bound_ms"] is not None else "-"
        print(f"{r['batch']:>5} {g:>10} {r['eager_ms']:>9.2f} {bound:>9} {xb:>8} "
              f"{r['output_tok_s']:>9.0f}")
    stats = engine.stats()
    report = {
        "model": "Llama-3.1-8B shape, random weights" if not args.dry_run else "tiny llama",
        "dtype": dtype, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "attention_backend": stats.attention_backend, "cuda_graphs": stats.cuda_graphs,
        "kernel_selftest": stats.kernel_selftest, "kernel_paths": stats.kernel_paths,
        "kernel_selftest_report": engine.selftest.as_dict(),  # its checks, seconds at start
        "copy_gbps": bandwidth / 1e9 if bandwidth else None, "weight_bytes": weight_bytes,
        "startup_s": startup,
        "rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
