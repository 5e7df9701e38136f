#!/usr/bin/env bash
# One check for an offline GPU machine (issue 28): lit_llm's imports, a bf16-mixed GRPO step and an SFT step through
# the real modules (tok/s per stage, MFU, peak memory), the GPU-relevant tests; at most 5 minutes; exit 0 = all passed.
#   benchmarks/gpu_check.sh [--model PATH] [--peak-tflops T] [--time-limit S] ...   (--help lists every option)
#   benchmarks/gpu_check.sh --download-wheels DIR --python 3.11 [--platform TAG] [PKG ...]   (on a networked machine)
# The interpreter: $PYTHON, else .venv/bin/python of this checkout when it exists, else python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "$root/benchmarks/gpu_check.py" "$@"
