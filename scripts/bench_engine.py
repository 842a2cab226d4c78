"""Engine throughput and KV memory: qworker's paged continuous batching vs static batching.

Workloads (``--workload``):

* ``sharegpt`` (default): ``--num-requests`` requests with ShareGPT-like long-tailed
  (log-normal) prompt and output lengths, fixed seed, each output forced to its drawn
  length (``ignore_eos``). Run through qworker and through ``transformers`` static
  batching: batches of ``--max-num-seqs`` requests in arrival order, left-padded with an
  attention mask, each batch generating until its longest member's length
  (``generate(min_new_tokens=max_new_tokens=...)``). Same model, machine and run. Reports
  both output-token throughputs (useful tokens only), their ratio, qworker's time-averaged
  KV pool usage and KV waste (allocated-but-unused token slots / allocated slots).
* ``shared-prefix``: requests sharing one 512-token instruction: qworker with automatic
  prefix caching on vs off.
* ``parallel``: parallel sampling n = 2, 4, 8 (siblings share prompt blocks with
  copy-on-write) vs n separate requests (prefix caching off for both): throughput in a
  pool that limits concurrency, and peak KV blocks in a pool roomy enough for all.
* ``structured``: schema-constrained extraction jobs vs the same jobs unconstrained
  with the same output lengths: per-output-token cost ratio and grammar compile time
  (``scripts/bench_structured.py``; needs llguidance and a tokenizer).
* ``all``: sharegpt, shared-prefix and parallel in turn.

The model defaults to a random Llama built here (``--preset``: ``mini`` 4 layers of
hidden 256 (~6M parameters), ``tiny`` ~16M parameters for CPU, ``small`` ~110M for
GPU). Prints a table and one JSON line per workload (``--out`` also writes them to a
file). Never asserts on speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.sampling_params import SamplingParams

PRESETS: dict[str, dict[str, Any]] = {
    "mini": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192},
    "tiny": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
             "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 8192},
    "small": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000},
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
}


def build_model(preset: str, folder: Path, dummy: bool = False) -> Path:
    """Write a seeded random Llama of ``preset`` size as safetensors into ``folder``
    (``dummy``: only its config.json; both sides then make random weights on the device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**PRESETS[preset], max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    if dummy:
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@dataclass(slots=True)
class Req:
    """One benchmark request: prompt ids, output length, and n."""

    prompt: list[int]
    output_len: int
    n: int = 1
    seed: int | None = None


@dataclass(slots=True)
class RunResult:
    """What one qworker run measured."""

    elapsed_s: float
    output_tokens: int
    kv_usage_avg: float = 0.0
    kv_waste: float = 0.0
    kv_blocks_avg: float = 0.0
    kv_blocks_peak: int = 0
    num_preemptions: int = 0
    prefix_cache_hits: int = 0
    num_kv_blocks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0


def lognormal_lengths(rng: random.Random, count: int, median: float, sigma: float,
                      lo: int, hi: int) -> list[int]:
    """Long-tailed lengths (log-normal around ``median``) clipped to ``[lo, hi]``."""
    return [min(hi, max(lo, int(rng.lognormvariate(math.log(median), sigma))))
            for _ in range(count)]


def sharegpt_requests(num: int, vocab: int, quick: bool, seed: int = 0) -> list[Req]:
    """ShareGPT-like requests: log-normal prompt and output lengths with long tails."""
    rng = random.Random(seed)
    scale = 0.5 if quick else 1.0
    prompts = lognormal_lengths(rng, num, 96 * scale, 0.9, 4, int(768 * scale))
    outputs = lognormal_lengths(rng, num, 64 * scale, 1.0, 4, int(512 * scale))
    return [Req([rng.randrange(3, vocab) for _ in range(p)], o)
            for p, o in zip(prompts, outputs, strict=True)]


def run_qworker(model: str, reqs: list[Req], args: argparse.Namespace,
                **overrides: Any) -> RunResult:
    """Push ``reqs`` through a fresh engine; sample pool figures at every step."""
    cfg = dict(model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
               load_format="dummy" if args.dummy else "auto")
    if args.threads:  # the same thread count on both sides
        cfg["cpu_threads"] = args.threads
    cfg.update(overrides)
    torch_threads = torch.get_num_threads()
    try:
        return _run_qworker(EngineConfig(**cfg), reqs)
    finally:  # the engine sets torch's process-wide count; the baseline keeps its own
        torch.set_num_threads(torch_threads)


def _run_qworker(config: EngineConfig, reqs: list[Req]) -> RunResult:
    engine = Engine(config)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("warmup", reqs[0].prompt[:8], warm)
    while engine.has_unfinished():
        engine.step()
    sync(engine.runner.device)
    for i, r in enumerate(reqs):
        engine.add_request(str(i), r.prompt, SamplingParams(
            n=r.n, temperature=0 if r.seed is None else 1.0, seed=r.seed,
            max_tokens=r.output_len, ignore_eos=True))
    pool = engine.kv.pool
    bs = engine.kv.block_size
    used_time = waste_alloc = waste_used = 0.0
    blocks_time = 0.0
    peak = 0
    out_tokens = 0
    start = last = time.perf_counter()
    while engine.has_unfinished():
        used_blocks = pool.num_used_blocks
        live_tokens = sum(s.num_computed_tokens for s in engine.scheduler.running)
        for out in engine.step():
            out_tokens += sum(len(c.token_ids) for c in out.outputs)
        sync(engine.runner.device)
        now = time.perf_counter()
        dt, last = now - last, now
        used_time += dt * pool.num_used_blocks / pool.num_blocks
        blocks_time += dt * used_blocks
        if used_blocks:
            waste_alloc += dt * used_blocks * bs
            waste_used += dt * min(live_tokens, used_blocks * bs)
        peak = max(peak, pool.num_used_blocks)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    release(engine)
    return RunResult(
        elapsed_s=elapsed, output_tokens=out_tokens,
        kv_usage_avg=used_time / elapsed if elapsed else 0.0,
        kv_waste=1 - waste_used / waste_alloc if waste_alloc else 0.0,
        kv_blocks_avg=blocks_time / elapsed if elapsed else 0.0, kv_blocks_peak=peak,
        num_preemptions=stats.num_preemptions, prefix_cache_hits=stats.prefix_cache_hits,
        num_kv_blocks=stats.num_kv_blocks,
        extra={"attention_backend": stats.attention_backend, "cuda_graphs": stats.cuda_graphs},
    )


def release(engine: Engine) -> None:
    """Free the engine's KV pool now: on a GPU the baseline model needs that memory next."""
    device = engine.runner.device
    engine.runner.kv_cache = None
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so timings are real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_static(model: str, reqs: list[Req], args: argparse.Namespace) -> RunResult:
    """transformers static batching: padded batches run to their longest member's length."""
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    if args.dummy:  # random weights made on the device, like the engine's
        from transformers import AutoConfig

        with torch.device(args.device):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model),
                                                  dtype=dtype).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    device = torch.device(args.device)

    def run_batch(batch: list[Req]) -> int:
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        longest = max(r.output_len for r in batch)
        with torch.inference_mode():
            hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                        min_new_tokens=longest, max_new_tokens=longest, pad_token_id=0)
        return sum(r.output_len for r in batch)  # only the tokens each request asked for

    run_batch(reqs[:1])  # warm-up
    sync(device)
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), args.max_num_seqs):
        tokens += run_batch(reqs[i:i + args.max_num_seqs])
    sync(device)
    return RunResult(elapsed_s=time.perf_counter() - start, output_tokens=tokens)


def emit(record: dict[str, Any], rows: list[tuple[str, ...]], args: argparse.Namespace) -> None:
    """Print a table and the JSON line (and append it to ``--out``)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(line + "\n")


def workload_sharegpt(model: str, args: argparse.Namespace, vocab: int) -> None:
    reqs = sharegpt_requests(args.num_requests, vocab, args.quick)
    q = run_qworker(model, reqs, args)
    h = run_hf_static(model, reqs, args)
    ratio = q.tok_s / h.tok_s if h.tok_s else float("inf")
    rows = [("system", "output tok/s", "elapsed s", "KV usage (avg)", "KV waste"),
            ("qworker", f"{q.tok_s:.1f}", f"{q.elapsed_s:.1f}", f"{q.kv_usage_avg:.1%}",
             f"{q.kv_waste:.2%}"),
            ("transformers static", f"{h.tok_s:.1f}", f"{h.elapsed_s:.1f}", "-", "-"),
            ("ratio", f"{ratio:.2f}x", "", "", "")]
    emit({"workload": "sharegpt", "num_requests": len(reqs), "output_tokens": q.output_tokens,
          "prompt_tokens": sum(len(r.prompt) for r in reqs),
          "qworker_tok_s": round(q.tok_s, 2), "hf_static_tok_s": round(h.tok_s, 2),
          "ratio": round(ratio, 3), "kv_usage_avg": round(q.kv_usage_avg, 4),
          "kv_waste": round(q.kv_waste, 4), "kv_blocks_peak": q.kv_blocks_peak,
          "num_kv_blocks": q.num_kv_blocks, "num_preemptions": q.num_preemptions,
          **common(args, q)}, rows, args)


def workload_shared_prefix(model: str, args: argparse.Namespace, vocab: int) -> None:
    rng = random.Random(1)
    instruction = [rng.randrange(3, vocab) for _ in range(256 if args.quick else 512)]
    suffixes = lognormal_lengths(rng, args.num_requests, 24, 0.7, 2, 128)
    outputs = lognormal_lengths(rng, args.num_requests, 24, 0.7, 2, 128)
    reqs = [Req(instruction + [rng.randrange(3, vocab) for _ in range(s)], o)
            for s, o in zip(suffixes, outputs, strict=True)]
    on = run_qworker(model, reqs, args, enable_prefix_caching=True)
    off = run_qworker(model, reqs, args, enable_prefix_caching=False)
    speedup = on.tok_s / off.tok_s if off.tok_s else float("inf")
    rows = [("prefix caching", "output tok/s", "elapsed s", "cache hit tokens"),
            ("on", f"{on.tok_s:.1f}", f"{on.elapsed_s:.1f}", str(on.prefix_cache_hits)),
            ("off", f"{off.tok_s:.1f}", f"{off.elapsed_s:.1f}", str(off.prefix_cache_hits)),
            ("speedup", f"{speedup:.2f}x", "", "")]
    emit({"workload": "shared-prefix", "num_requests": len(reqs),
          "shared_prefix_tokens": len(instruction), "on_tok_s": round(on.tok_s, 2),
          "off_tok_s": round(off.tok_s, 2), "speedup": round(speedup, 3),
          "prefix_cache_hits": on.prefix_cache_hits, **common(args, on)}, rows, args)


def workload_parallel(model: str, args: argparse.Namespace, vocab: int) -> None:
    rng = random.Random(2)
    prompt_len, out_len = (128, 32) if args.quick else (256, 48)
    num_prompts = max(2, args.num_requests // 16)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    per_seq = -(-(prompt_len + out_len) // args.block_size)
    # Throughput in a pool for half of max_num_seqs unshared sequences (memory, not
    # max_num_seqs, limits concurrency); memory in a pool roomy enough for every sequence.
    blocks = args.num_kv_blocks or max(per_seq * 2, per_seq * args.max_num_seqs // 2)
    roomy = per_seq * (args.max_num_seqs + 8)
    rows = [("n", "forked tok/s", "separate tok/s", "speedup", "peak KV blocks forked",
             "separate", "saved")]
    record: dict[str, Any] = {"workload": "parallel", "num_prompts": num_prompts,
                              "prompt_len": prompt_len, "output_len": out_len,
                              "num_kv_blocks": blocks, "results": {}}
    last = None
    for n in (2, 4, 8):
        forked = [Req(p, out_len, n=n, seed=i) for i, p in enumerate(prompts)]
        separate = [Req(p, out_len, seed=i * 100 + j) for i, p in enumerate(prompts)
                    for j in range(n)]
        nocache = {"enable_prefix_caching": False}
        f = run_qworker(model, forked, args, num_kv_blocks=blocks, **nocache)
        s = run_qworker(model, separate, args, num_kv_blocks=blocks, **nocache)
        fm = run_qworker(model, forked, args, num_kv_blocks=roomy, **nocache)
        sm = run_qworker(model, separate, args, num_kv_blocks=roomy, **nocache)
        saved = 1 - fm.kv_blocks_peak / sm.kv_blocks_peak if sm.kv_blocks_peak else 0.0
        speedup = f.tok_s / s.tok_s if s.tok_s else float("inf")
        rows.append((str(n), f"{f.tok_s:.1f}", f"{s.tok_s:.1f}", f"{speedup:.2f}x",
                     str(fm.kv_blocks_peak), str(sm.kv_blocks_peak), f"{saved:.1%}"))
        record["results"][str(n)] = {
            "forked_tok_s": round(f.tok_s, 2), "separate_tok_s": round(s.tok_s, 2),
            "speedup": round(speedup, 3), "kv_blocks_peak_forked": fm.kv_blocks_peak,
            "kv_blocks_peak_separate": sm.kv_blocks_peak, "kv_saved": round(saved, 4),
            "preemptions_forked": f.num_preemptions, "preemptions_separate": s.num_preemptions,
        }
        last = f
    assert last is not None
    emit({**record, "roomy_num_kv_blocks": roomy, **common(args, last)}, rows, args)


def common(args: argparse.Namespace, r: RunResult) -> dict[str, Any]:
    """Settings every JSON line carries."""
    return {"model": args.model_label, "device": args.device, "dtype": args.dtype,
            "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
            "attention_backend": r.extra.get("attention_backend"),
            "cuda_graphs": r.extra.get("cuda_graphs"),
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload",
                   choices=["sharegpt", "shared-prefix", "parallel", "structured", "all"],
                   default="sharegpt", help="what to measure (default: sharegpt)")
    p.add_argument("--model", default=None,
                   help="HF model directory (default: build a random Llama of --preset)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="size of the random Llama built when --model is not given")
    p.add_argument("--num-requests", type=int, default=200, help="requests (default 200)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="qworker's max_num_seqs and the static batch size (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="qworker's per-step token budget (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="qworker pool size in blocks (default: engine sizing)")
    p.add_argument("--max-model-len", type=int, default=2048, help="default 2048")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dummy", action="store_true",
                   help="write only the preset's config.json; qworker and transformers both "
                        "make random weights on the device (big shapes, no disk)")
    p.add_argument("--quick", action="store_true",
                   help="shorter prompts/outputs (half the lengths) for a fast look")
    p.add_argument("--dry-run", action="store_true",
                   help="plumbing check: CPU, fp32, tiny model, 16 requests, --quick")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--output-len", type=int, default=96,
                   help="structured: max_tokens of each answer (default 96)")
    p.add_argument("--max-string", type=int, default=24,
                   help="structured: maxLength given to the schemas' strings (default 24)")
    p.add_argument("--tokenizer", default=None,
                   help="structured: tokenizer dir for the random model (default: SmolLM2's)")
    p.add_argument("--rounds", type=int, default=3,
                   help="structured: runs of each variant, alternating; best counts (default 3)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="structured: sampling temperature of both runs (default 0, greedy)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.quick = "cpu", "float32", True
        args.num_requests = min(args.num_requests, 16)
        args.model = None
        args.preset = "tiny"
        args.output_len, args.rounds = min(args.output_len, 32), 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.workload == "structured":
            from scripts.bench_structured import workload_structured

            workload_structured(args, PRESETS, emit, Path(tmp))
            return 0
        if args.model:
            args.dummy = False
        model = args.model or str(build_model(args.preset, Path(tmp) / "model", args.dummy))
        args.model_label = args.model or f"random-llama-{args.preset}"
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        todo = (["sharegpt", "shared-prefix", "parallel"] if args.workload == "all"
                else [args.workload])
        for name in todo:
            {"sharegpt": workload_sharegpt, "shared-prefix": workload_shared_prefix,
             "parallel": workload_parallel}[name](model, args, vocab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
