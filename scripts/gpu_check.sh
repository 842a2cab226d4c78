#!/usr/bin/env bash
# The GPU check (issue 23), built for one rare call of the device tool (15 minutes of H200 per
# lucky session, the machine's start included). The stages, in order of value, each under its
# own limit (scripts/gpu_check_stages.py, STAGES: one line each):
#   setup (every call): info 10 s, deps 10 s (gpu_deps/ wheels), precompile 35 s (every kernel
#     into cupy's cache, 16 processes)
#   call 1 (330 s of limits): pytest -m gpu for the self-test, the bf16/fp16 engine, the decode
#     and prefill kernels (one process per file, -rfE); the decode table (bench_kernels);
#     decode step time with graphs on/off (bench_step_time, a profiled step)
#   call 2 (330 s): fixed-length 1000/1000 on the 8B shape (bench_fixed_len), the other gpu
#     test files
#   call 3: the engine against transformers (bench_engine), structured outputs, later stages
# `--plan` prints the plan the table gives today. Estimates of each stage's GPU time and the
# whole session plan are in docs/gpu/README.md.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--plan] [--call N | --all] [--budget S]
#   OUT                          results folder (default ./out); PYTHON (default python3)
#   --dry-run, or QWORKER_GPU_CHECK_DRY_RUN=1: every stage on the CPU at toy sizes (plumbing;
#                                limits x3)
#   QWORKER_GPU_CHECK_CALL=N     the call of the plan to run (default 1); --all runs them all
#   QWORKER_GPU_CHECK_ONLY="kernels pytest:attention/*"   just these stages (names or globs;
#                                setup still runs): the rerun of failed stages
#   QWORKER_GPU_CHECK_SKIP="structured"   stages not to run (reported excluded)
#   QWORKER_GPU_CHECK_LIMITS="kernels=80"  other limits for a rerun (STAGE=SECONDS ...)
#   QWORKER_GPU_CHECK_BUDGET     seconds of stage limits per call (default 330)
#   QWORKER_GPU_DEPS             carried wheels (default gpu_deps/, git-ignored): fill it with
#                                scripts/pack_gpu_deps.sh and name it in the tool's carry
#   QWORKER_GPU_CHECK_MODEL_DIR  a model dir with weights instead of the random 8B shape
#   FIXED_SECONDS                measuring time of the fixed-length run (default 40)
#   QWORKER_BENCH_ENGINE_ARGS    extra arguments for the engine stage
# $OUT gets at most 6 files, flat: report.json (every stage's record, its JSON result or pytest
# summary embedded, the targets, the commands for what is left), report.md, gpu_check.log
# (every stage's output), decode_step_trace.json.gz. Both reports are rewritten after every
# stage, so a run killed from outside still returns what it measured (verdict "running").
# Exit status: 0 every stage of the call passed, 1 one failed or timed out, 3 one skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"
    exit 0
  fi
done
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
