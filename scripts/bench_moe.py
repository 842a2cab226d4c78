"""Our MoE block forward against transformers' MoE block forward, side by side.

Both blocks hold the same random weights (a Qwen3-MoE-style sparse block: router, top-k
renormalised, experts of ``--moe-inter`` width; ``--shared`` adds Qwen2-MoE's shared
expert). For each token count (decode-sized and prefill-sized batches) the two forwards
alternate, best of ``--repeats`` rounds of ``--iters`` calls each. transformers runs its
default experts implementation (``grouped_mm``, what ``from_pretrained`` picks) and, for
reference, its ``eager`` per-expert loop. Prints a table and one JSON line (also to
``--out``); never asserts on speed. The outputs are checked equal first.

    python scripts/bench_moe.py [--threads 1] [--tokens 8 32 256] [--experts 64 --top-k 8]
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

from qworker.models.layers import activation
from qworker.models.moe import RouterSpec, SparseMoeBlock
from qworker.models.moe_exec import expert_path


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
          ) -> tuple[SparseMoeBlock, dict[str, Any]]:
    """Our block and transformers' (one per experts implementation), same weights."""
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    common = {"hidden_size": args.hidden, "moe_intermediate_size": args.moe_inter,
              "num_experts": args.experts, "num_experts_per_tok": args.top_k,
              "norm_topk_prob": True, "hidden_act": "silu"}
    if args.shared:
        config = transformers.Qwen2MoeConfig(**common,
                                             shared_expert_intermediate_size=args.shared)
        cls: Any = Qwen2MoeSparseMoeBlock
    else:
        config = transformers.Qwen3MoeConfig(**common)
        cls = Qwen3MoeSparseMoeBlock
    theirs: dict[str, Any] = {}
    torch.manual_seed(0)
    for impl in ("grouped_mm", "eager"):
        config._experts_implementation = impl
        block = cls(config)
        if theirs:
            block.load_state_dict(next(iter(theirs.values())).state_dict())
        else:
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, 0.05)
        theirs[impl] = block.to(device, dtype).eval()
    router = RouterSpec(args.experts, args.top_k, True, True)
    ours = SparseMoeBlock(args.hidden, args.moe_inter, router, activation("silu"),
                          shared_inter=args.shared or None)
    state = theirs["grouped_mm"].state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(state["gate.weight"])
        ours.experts.load("gate_up_proj", state["experts.gate_up_proj"])
        ours.experts.load("down_proj", state["experts.down_proj"])
        if ours.shared_expert is not None and ours.shared_expert_gate is not None:
            for part in ("gate", "up"):
                ours.shared_expert.gate_up_proj.load_shard(
                    part, "weight", state[f"shared_expert.{part}_proj.weight"])
            ours.shared_expert.down_proj.weight.copy_(state["shared_expert.down_proj.weight"])
            ours.shared_expert_gate.weight.copy_(state["shared_expert_gate.weight"])
    return ours.to(device, dtype).eval(), theirs


def timed(fn: Any, x: torch.Tensor, iters: int, device: torch.device) -> float:
    """Milliseconds per call over ``iters`` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    """Build the blocks, check them equal, time them alternately, print table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--moe-inter", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--shared", type=int, default=0, help="shared expert width (0: none)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ours, theirs = build(args, device, dtype)
    ours_fn = ours
    hf_fn = {impl: (lambda x, b=b: b(x.unsqueeze(0))[0]) for impl, b in theirs.items()}
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randn(n, args.hidden, generator=torch.Generator().manual_seed(n)
                            ).to(device, dtype)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            torch.testing.assert_close(ours_fn(x), hf_fn["grouped_mm"](x), rtol=tol, atol=tol)
            best = {"ours": float("inf"), "grouped_mm": float("inf"), "eager": float("inf")}
            for _ in range(args.repeats):
                best["ours"] = min(best["ours"], timed(ours_fn, x, args.iters, device))
                for impl, fn in hf_fn.items():
                    best[impl] = min(best[impl], timed(fn, x, args.iters, device))
            rows.append({"tokens": n, "ours_ms": round(best["ours"], 3),
                         "transformers_ms": round(best["grouped_mm"], 3),
                         "transformers_eager_ms": round(best["eager"], 3),
                         "ratio": round(best["grouped_mm"] / best["ours"], 2),
                         "ratio_vs_eager": round(best["eager"] / best["ours"], 2)})
    path = expert_path(device, dtype, args.hidden, args.moe_inter).value
    print(f"MoE block: hidden {args.hidden}, {args.experts} experts of {args.moe_inter}, "
          f"top-{args.top_k}, shared {args.shared or 'none'}; {device} {args.dtype}, "
          f"threads {args.threads}; our experts path: {path}")
    print(f"{'tokens':>7} {'ours ms':>9} {'hf ms':>9} {'hf eager ms':>12} {'ratio':>7} "
          f"{'vs eager':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['ours_ms']:>9.3f} {r['transformers_ms']:>9.3f} "
              f"{r['transformers_eager_ms']:>12.3f} {r['ratio']:>6.2f}x "
              f"{r['ratio_vs_eager']:>8.2f}x")
    total_ours = sum(r["ours_ms"] for r in rows)
    total_hf = sum(r["transformers_ms"] for r in rows)
    report = {"bench": "moe", "device": str(device), "dtype": args.dtype,
              "threads": args.threads, "hidden": args.hidden, "experts": args.experts,
              "moe_inter": args.moe_inter, "top_k": args.top_k, "shared": args.shared,
              "experts_path": path, "rows": rows,
              "ratio_all_rows": round(total_hf / total_ours, 2),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    line = json.dumps(report)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
