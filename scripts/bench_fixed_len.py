"""Fixed-length throughput: Llama-3.1-8B shape (or Qwen3-30B-A3B), bf16 or FP8, random weights.

Comparable with published figures for the same workload (TensorRT-LLM: 17.7k output tok/s on
one H200 in FP8; vLLM: about 6k on an H100 in bf16 at 256/256). By default only a config.json
is written and the engine makes random weights on the device (``load_format="dummy"``: no
weight file is written or read; no tokenizer: prompts are token ids); ``--model`` uses a
directory that holds weights instead. Requests are queued
(more than fit at once, so the batch stays full) and the engine steps until ``--seconds``
have passed or all finish. Reported: output tokens/s (every generated token over the
elapsed time), requests/s (finished requests over the elapsed time), and the counts.

``--shape qwen3-30b-a3b`` runs the Qwen3-30B-A3B MoE shape instead (128 experts, top-8;
dummy weights); ``--quantization fp8`` quantizes on load; ``--compare-fp8`` runs the same
workload with ``quantization=none`` then ``fp8`` in one run and reports the output tok/s
and weight-byte ratios (the weight bytes count what the engine holds; on the CPU, packed
matmul weights are not counted).
``--make-model DIR`` only writes a model with real (random) weight files;
``--dry-run`` uses a tiny model on the CPU to prove the plumbing. Never asserts on speed.
"""

from __future__ import annotations

import argparse
import json
import random
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
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
QWEN3_30B_A3B: dict[str, Any] = {  # Qwen/Qwen3-30B-A3B's config.json
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
TINY_MOE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}


def llama_tensors(shape: dict[str, Any], layer: int | None) -> dict[str, tuple[int, ...]]:
    """transformers' Llama tensor names and shapes: one layer's, or the non-layer ones."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d
    if layer is None:
        return {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                "lm_head.weight": (v, h)}  # fmt: skip
    p = f"model.layers.{layer}."
    return {
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }


def make_model(folder: Path, shape: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> Path:
    """Write random safetensors shards (one per 4 layers), then config.json, into ``folder``."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape, tie_word_embeddings=False, torch_dtype=str(dtype).split(".")[1])
    config.architectures = ["LlamaForCausalLM"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    groups: list[list[int | None]] = [[None]]
    layers = list(range(shape["num_hidden_layers"]))
    groups += [list(layers[k : k + 4]) for k in range(0, len(layers), 4)]
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for n, group in enumerate(groups):
        shard: dict[str, torch.Tensor] = {}
        for layer in group:
            for name, dims in llama_tensors(shape, layer).items():
                if len(dims) == 1:
                    t = torch.ones(dims, dtype=dtype, device=device)
                else:
                    t = torch.randn(dims, generator=gen, device=device).mul_(0.02).to(dtype)
                shard[name] = t.cpu()
                total_bytes += t.numel() * t.element_size()
        file_name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    # The index makes the shards loadable by transformers too (the engine benchmark's baseline).
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(str(folder))  # last: a folder with config.json is complete
    return folder


def write_config(folder: Path, shape: dict[str, Any], dtype: torch.dtype,
                 moe: bool = False) -> Path:
    """Only the config.json of the shape (a Llama, or with ``moe`` a Qwen3-MoE): the engine
    makes the weights on the device."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    cls, arch = ((transformers.Qwen3MoeConfig, "Qwen3MoeForCausalLM") if moe
                 else (transformers.LlamaConfig, "LlamaForCausalLM"))
    config = cls(**shape, tie_word_embeddings=False, torch_dtype=str(dtype).split(".")[1])
    config.architectures = [arch]
    config.save_pretrained(str(folder))
    return folder


def run(
    engine: Engine, prompts: list[list[int]], output_len: int, seconds: float
) -> dict[str, Any]:
    """Queue every prompt, step until done or ``seconds`` passed; count what came out."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats().generation_tokens
    start = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params)
    finished = steps = 0
    while engine.has_unfinished():
        finished += len(engine.step())
        steps += 1
        if time.perf_counter() - start > seconds:
            break
    elapsed = time.perf_counter() - start
    generated = engine.stats().generation_tokens - before
    return {
        "requests_queued": len(prompts),
        "requests_finished": finished,
        "generated_tokens": generated,
        "steps": steps,
        "elapsed_s": elapsed,
        "output_tok_per_s": generated / elapsed,
        "req_per_s": finished / elapsed,
        "finished_output_tok_per_s": finished * output_len / elapsed,
    }


def bench_once(args: argparse.Namespace, shape: dict[str, Any], quantization: str
               ) -> dict[str, Any]:
    """One engine over the workload (``quantization``: the engine knob); its report."""
    moe = args.shape == "qwen3-30b-a3b"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    t0 = time.perf_counter()
    load_format = "auto"
    folder = args.model
    if folder is None or not (folder / "config.json").exists():
        folder = write_config(folder or Path(tempfile.mkdtemp(prefix="qworker_fixed_")),
                              shape, dtype, moe=moe)
        load_format = "dummy"
    made = time.perf_counter() - t0
    device = "cpu" if args.dry_run else "cuda"
    config = EngineConfig(
        model=str(folder),
        dtype="float32" if args.dry_run else "bfloat16",
        device=device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,
        kv_cache_memory=(256 << 20) if args.dry_run else None,
        load_format=load_format,
        quantization=quantization,
    )
    t0 = time.perf_counter()
    engine = Engine(config)
    loaded = time.perf_counter() - t0
    from qworker.models.quant import weight_bytes

    weights = weight_bytes(engine.runner.model)
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    run(engine, [[rng.randrange(vocab) for _ in range(16)]], 8, 60.0)  # warm-up: kernels, cuda init
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)]
        for _ in range(args.waves * args.max_num_seqs)
    ]
    result = run(engine, prompts, args.output_len, args.seconds)
    stats = engine.stats()
    names = {"llama-3.1-8b": "Llama-3.1-8B shape", "qwen3-30b-a3b": "Qwen3-30B-A3B shape"}
    report = {
        "workload": f"{args.input_len} in / {args.output_len} out, random token ids, greedy",
        "model": (f"{names[args.shape]}, random weights" if not args.dry_run
                  else f"tiny {'qwen3-moe' if moe else 'llama'}"),
        "dtype": config.dtype,
        "quantization": quantization,
        "weight_bytes": weights,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "attention_backend": stats.attention_backend,
        "kernel_selftest": stats.kernel_selftest,
        "kernel_paths": stats.kernel_paths,
        "cuda_graphs": stats.cuda_graphs,
        "max_num_seqs": args.max_num_seqs,
        "num_kv_blocks": stats.num_kv_blocks,
        "num_preemptions": stats.num_preemptions,
        "model_write_s": made,
        "load_format": load_format,
        "engine_load_s": loaded,
        **result,
    }
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return report


def main() -> None:
    """Build or reuse the model, run the fixed-length workload, print table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model dir (written there if absent)")
    parser.add_argument("--make-model", type=Path, help="only write the model into this dir")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--shape", choices=["llama-3.1-8b", "qwen3-30b-a3b"],
                        default="llama-3.1-8b", help="the model shape (dummy weights)")
    parser.add_argument("--quantization", choices=["auto", "fp8", "none"], default="auto",
                        help="the engine's quantization knob")
    parser.add_argument("--compare-fp8", action="store_true",
                        help="run quantization=none then fp8 in this run; report the ratio")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--waves", type=int, default=4, help="queued requests = waves x seqs")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()

    moe = args.shape == "qwen3-30b-a3b"
    if args.dry_run:
        shape, dtype = (TINY_MOE if moe else TINY), torch.float32
    else:
        shape, dtype = (QWEN3_30B_A3B if moe else LLAMA_31_8B), torch.bfloat16
    if args.make_model is not None:
        if moe:
            raise SystemExit("--make-model writes Llama shapes only; MoE shapes run on dummy "
                             "weights")
        if not (args.make_model / "config.json").exists():
            make_model(args.make_model, shape, dtype)
        print(f"model written to {args.make_model}")
        return
    if args.dry_run:
        args.input_len, args.output_len = min(args.input_len, 16), min(args.output_len, 16)
        args.max_num_seqs, args.seconds = min(args.max_num_seqs, 4), min(args.seconds, 20.0)
    modes = ["none", "fp8"] if args.compare_fp8 else [args.quantization]
    reports = [bench_once(args, shape, mode) for mode in modes]
    print(f"{'quantization':>12} {'output tok/s':>12} {'req/s':>7} {'finished':>8} "
          f"{'generated':>9} {'elapsed s':>9} {'weights GiB':>11}")
    for r in reports:
        print(f"{r['quantization']:>12} {r['output_tok_per_s']:>12.0f} {r['req_per_s']:>7.2f} "
              f"{r['requests_finished']:>8} {r['generated_tokens']:>9} "
              f"{r['elapsed_s']:>9.1f} {r['weight_bytes'] / 2**30:>11.2f}")  # fmt: skip
    report = reports[0] if len(reports) == 1 else {
        **reports[1], "baseline": reports[0],
        "fp8_over_bf16_output_tok_per_s": reports[1]["output_tok_per_s"]
        / reports[0]["output_tok_per_s"],
        "fp8_over_bf16_weight_bytes": reports[1]["weight_bytes"] / reports[0]["weight_bytes"],
    }
    if len(reports) == 2:
        print(f"fp8 / bf16: output tok/s {report['fp8_over_bf16_output_tok_per_s']:.2f}x, "
              f"weight bytes {report['fp8_over_bf16_weight_bytes']:.3f}")
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
