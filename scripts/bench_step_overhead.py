"""Host overhead of one decode step: the engine with its model replaced by a stub.

Everything the host does per step runs for real — inbox, scheduler, KV block
bookkeeping, step inputs and attention metadata, logits row selection, sampling,
stop checks, stats snapshot — while the model's forward returns zeros and its
``compute_logits`` a fixed random table (so greedy picks differ per row), and the
attention backend is never called. ``--batch`` sequences run in decode while
``--waiting`` more wait for a slot (none finishes: ``ignore_eos`` and a large
``max_tokens``), which is the state of a saturated worker.

``--baseline DIR`` runs the same measurement again with ``qworker`` imported from
``DIR`` (for example a checkout of main) and prints both side by side with their ratio.
Prints one JSON line per tree; the last line is
``host overhead: X ms per decode step (batch B, W waiting)`` where X is the engine
thread's CPU time per step (``time.thread_time``: on a shared machine wall time also
counts the time other processes hold the core; both are in the JSON). Never asserts
on speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_TREE_FLAG = "--tree"


def _tree_from_argv() -> Path:
    if _TREE_FLAG in sys.argv:
        return Path(sys.argv[sys.argv.index(_TREE_FLAG) + 1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_tree_from_argv()))

import torch  # noqa: E402
from torch import nn  # noqa: E402


class StubModel(nn.Module):
    """Stands in for a ``CausalLM``: zeros for hidden states, a fixed logits table."""

    def __init__(self, hidden: int, vocab: int, rows: int) -> None:
        super().__init__()
        self.hidden = hidden
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(rows, vocab, generator=gen)
        self.forwards = 0

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Zeros ``[num_tokens, hidden]`` whatever the step (attention never runs)."""
        self.forwards += 1
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first ``len(hidden)`` rows of the fixed table."""
        return self.table[: hidden.shape[0]]


def build_model_dir(folder: Path, vocab: int, max_len: int) -> Path:
    """A 1-layer random Llama (only its shapes matter: the forward is stubbed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the stubbed engine; per-step wall times of the steady decode phase."""
    from qworker.engine.config import EngineConfig
    from qworker.engine.engine import Engine
    from qworker.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    max_len = args.prompt_len + args.warmup_steps + args.steps + 64
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "m", args.vocab, max_len)
        blocks_per_seq = -(-max_len // 16)
        engine = Engine(EngineConfig(
            model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
            max_model_len=max_len, num_kv_blocks=blocks_per_seq * (args.batch + 4),
            enable_prefix_caching=True))
    stub = StubModel(engine.spec.hidden_size, engine.spec.vocab_size, args.batch)
    engine.runner.model = stub
    if args.overlap and hasattr(engine, "async_scheduling"):
        engine.async_scheduling = True  # the GPU path: launch N+1 before processing N
    params = SamplingParams(temperature=0.0, max_tokens=max_len, ignore_eos=True)
    prompt = [3 + (i % (args.vocab - 3)) for i in range(args.prompt_len)]
    for i in range(args.batch):  # distinct first tokens: no prefix sharing
        engine.add_request(f"run{i}", [3 + i % (args.vocab - 3), *prompt[1:]], params)
    for _ in range(args.warmup_steps):
        engine.step()
    for i in range(args.waiting):
        engine.add_request(f"wait{i}", [3 + (i * 7) % (args.vocab - 3), *prompt[1:]], params)
    engine.step()  # moves the waiting requests from the inbox to the scheduler
    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
    stats = engine.stats()
    times.sort()
    cpu.sort()
    mean_ms = 1e3 * sum(times) / len(times)
    return {
        "tree": str(_tree_from_argv()),
        "batch": args.batch,
        "waiting": args.waiting,
        "running": stats["num_requests_running"],
        "queued": stats["num_requests_waiting"],
        "steps": args.steps,
        "vocab": args.vocab,
        "overlap": bool(args.overlap and hasattr(engine, "async_scheduling")),
        "mean_ms": round(mean_ms, 4),
        "cpu_mean_ms": round(1e3 * sum(cpu) / len(cpu), 4),
        "cpu_median_ms": round(1e3 * cpu[len(cpu) // 2], 4),
        "median_ms": round(1e3 * times[len(times) // 2], 4),
        "p90_ms": round(1e3 * times[int(len(times) * 0.9)], 4),
        "generated": stats["generation_tokens"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="running sequences (default 256)")
    p.add_argument("--waiting", type=int, default=1000, help="queued requests (default 1000)")
    p.add_argument("--steps", type=int, default=200, help="measured decode steps (default 200)")
    p.add_argument("--warmup-steps", type=int, default=20, help="unmeasured first steps")
    p.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens (default 1000)")
    p.add_argument("--vocab", type=int, default=256,
                   help="vocabulary of the stub's logits (default 256: the sampler's "
                        "arithmetic, device work on a GPU, stays small beside the host work)")
    p.add_argument("--overlap", action="store_true",
                   help="run with async scheduling on (the GPU default; the CPU's is off)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="also measure with qworker imported from this directory")
    p.add_argument(_TREE_FLAG, type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ours = measure(args)
    if args.json_only:
        print(json.dumps(ours), flush=True)
        return 0
    print(json.dumps(ours), flush=True)
    if args.baseline is not None:
        cmd = [sys.executable, __file__, _TREE_FLAG, str(args.baseline), "--json-only",
               "--batch", str(args.batch), "--waiting", str(args.waiting), "--steps",
               str(args.steps), "--warmup-steps", str(args.warmup_steps), "--prompt-len",
               str(args.prompt_len), "--vocab", str(args.vocab)] + (
                   ["--overlap"] if args.overlap else [])
        env = {**os.environ, "PYTHONPATH": str(args.baseline)}
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        base = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(base), flush=True)
        print(f"{'tree':<40} {'cpu ms':>8} {'wall ms':>8} {'median':>8} {'p90':>8}")
        for row in (base, ours):
            print(f"{row['tree'][-40:]:<40} {row['cpu_mean_ms']:>8.3f} {row['mean_ms']:>8.3f} "
                  f"{row['median_ms']:>8.3f} {row['p90_ms']:>8.3f}")
        print(f"speedup vs baseline: {base['cpu_mean_ms'] / ours['cpu_mean_ms']:.2f}x (cpu), "
              f"{base['mean_ms'] / ours['mean_ms']:.2f}x (wall)")
    print(f"host overhead: {ours['cpu_mean_ms']:.2f} ms per decode step "
          f"(batch {args.batch}, {args.waiting} waiting)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
