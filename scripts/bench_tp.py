"""Tensor parallelism: TP 2 against TP 1 measured side by side in one run.

CPU (default): the step-time overhead of two ranks over one on the same cores. TP 1
gets every core (``cpu_threads``), each of the two TP ranks half of them, so the model's
arithmetic is the same in both and the ratio TP2 / TP1 is what the split costs: the
collectives (two all-reduces per layer, the embedding's, the logits gather), the step
message to the follower, and the two processes waiting for each other. A Llama-shaped
model with random weights (``load_format="dummy"``) decodes batches of ``--batches``
sequences (each timed over ``--steps`` steps after their prefill), and one prefill
step of ``--prefill`` tokens is timed as well.

GPU (``--gpu``, 2+ GPUs, else a JSON line saying it was skipped): fixed-length
throughput, Llama-3.1-8B shape in bf16 with random weights made on each GPU, 1000 in /
1000 out, TP 1 then TP 2; the ratio of output tokens/s is the scaling (target >= 1.7).

Prints a table and one JSON line (``--out`` writes it too). Never asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.sampling_params import SamplingParams

CPU_SHAPE: dict[str, Any] = {
    "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _decode_ms(engine: Engine, batch: int, context: int, steps: int, vocab: int) -> float:
    """Median ms of one pure-decode step of ``batch`` sequences (prefilled first)."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [rng.randrange(3, vocab) for _ in range(context)],
                           params)
    while engine.stats().num_requests_waiting or not engine.stats().generation_tokens:
        engine.step()  # prefill (chunks) until every sequence decodes
    engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    return 1000 * statistics.median(times)


def _prefill_ms(engine: Engine, tokens: int, vocab: int, repeats: int = 3) -> float:
    rng = random.Random(tokens)
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for r in range(repeats):
        engine.add_request(f"p{tokens}-{r}", [rng.randrange(3, vocab) for _ in range(tokens)],
                           params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def cpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    """TP 1 on every core vs TP 2 on half the cores each, same model shape."""
    from bench_step_time import write_config

    folder = write_config(Path(tempfile.mkdtemp(prefix="qworker_tp_")), CPU_SHAPE, "float32")
    cores = args.threads or _cores()
    rows: dict[str, dict[str, float]] = {}
    for tp in (1, 2):
        config = EngineConfig(
            model=str(folder), dtype="float32", device="cpu", load_format="dummy",
            tensor_parallel_size=tp, cpu_threads=max(1, cores // tp), max_num_seqs=64,
            max_num_batched_tokens=max(args.prefill, 64), max_model_len=1024,
            kv_cache_memory=256 << 20, enable_prefix_caching=False)
        t0 = time.perf_counter()
        engine = Engine(config)
        started = time.perf_counter() - t0
        try:
            _decode_ms(engine, 1, 8, 3, CPU_SHAPE["vocab_size"])  # warm-up
            row = {"startup_s": started}
            for batch in args.batches:
                row[f"decode{batch}_ms"] = _decode_ms(engine, batch, args.context, args.steps,
                                                      CPU_SHAPE["vocab_size"])
            row[f"prefill{args.prefill}_ms"] = _prefill_ms(engine, args.prefill,
                                                           CPU_SHAPE["vocab_size"])
            rows[f"tp{tp}"] = row
        finally:
            engine.close()
    keys = [k for k in rows["tp1"] if k.endswith("_ms")]
    ratios = {k.removesuffix("_ms"): rows["tp2"][k] / rows["tp1"][k] for k in keys}
    print(f"CPU, {cores} cores; TP 1: {cores} threads, TP 2: {max(1, cores // 2)} per rank; "
          f"{CPU_SHAPE['num_hidden_layers']} layers -> "
          f"{2 * CPU_SHAPE['num_hidden_layers'] + 2} collectives + 1 step message per step")
    print(f"{'step':>14} {'TP1 ms':>9} {'TP2 ms':>9} {'TP2/TP1':>8}")
    for k in keys:
        print(f"{k.removesuffix('_ms'):>14} {rows['tp1'][k]:>9.2f} {rows['tp2'][k]:>9.2f} "
              f"{ratios[k.removesuffix('_ms')]:>8.2f}")
    load = os.getloadavg()[0]
    print(f"load average at the end: {load:.1f} (other processes on these cores skew both)")
    return {"mode": "cpu", "cores": cores, "shape": CPU_SHAPE, "context": args.context,
            "steps": args.steps, "loadavg_1m": load, **rows, "tp2_over_tp1": ratios}


def gpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Fixed-length output tokens/s of TP 1 and TP 2 on the Llama-3.1-8B shape."""
    from bench_fixed_len import LLAMA_31_8B, run, write_config

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < 2:
        print(f"TP scaling skipped: needs 2 GPUs, found {found}")
        return {"mode": "gpu", "skipped": f"needs 2 GPUs, found {found}"}
    folder = write_config(Path(tempfile.mkdtemp(prefix="qworker_llama8b_")), LLAMA_31_8B,
                          torch.bfloat16)
    rng = random.Random(0)
    vocab = LLAMA_31_8B["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.waves * args.max_num_seqs)]
    results: dict[str, Any] = {}
    for tp in (1, 2):
        config = EngineConfig(
            model=str(folder), dtype="bfloat16", device="cuda", load_format="dummy",
            tensor_parallel_size=tp, max_num_seqs=args.max_num_seqs,
            max_model_len=args.input_len + args.output_len + 16, enable_prefix_caching=False)
        t0 = time.perf_counter()
        engine = Engine(config)
        loaded = time.perf_counter() - t0
        try:
            run(engine, [[rng.randrange(vocab) for _ in range(16)]], 8, 60.0)  # warm-up
            result = run(engine, prompts, args.output_len, args.seconds)
            stats = engine.stats()
            results[f"tp{tp}"] = {"engine_load_s": loaded, "num_kv_blocks": stats.num_kv_blocks,
                                  "cuda_graphs": stats.cuda_graphs, **result}
        finally:
            engine.close()
    scaling = results["tp2"]["output_tok_per_s"] / results["tp1"]["output_tok_per_s"]
    print(f"{'':>4} {'output tok/s':>12} {'finished':>8} {'KV blocks':>9} {'load s':>7}")
    for tp in ("tp1", "tp2"):
        r = results[tp]
        print(f"{tp:>4} {r['output_tok_per_s']:>12.0f} {r['requests_finished']:>8} "
              f"{r['num_kv_blocks']:>9} {r['engine_load_s']:>7.1f}")
    print(f"TP 2 / TP 1 output tok/s: {scaling:.2f} (target >= 1.7)")
    return {"mode": "gpu", "workload": f"{args.input_len} in / {args.output_len} out",
            "device": torch.cuda.get_device_name(), **results, "scaling": scaling}


def main() -> None:
    """Run the CPU or GPU comparison; print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="TP-2 8B scaling on 2+ GPUs")
    parser.add_argument("--threads", type=int, default=0, help="CPU cores to use (default all)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=60.0, help="GPU: measuring time")
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--waves", type=int, default=2, help="GPU: requests = waves x seqs")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    report = gpu_bench(args) if args.gpu else cpu_bench(args)
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
