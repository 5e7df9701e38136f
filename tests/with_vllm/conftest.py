"""Fixtures of the vLLM suite (``make test-vllm``): the ``tiny-vllm`` model as an HF model (the reference the engine is
compared with); inputs are built by ``vllm_test_inputs``. Each test module starts its own engine once (module-scoped
fixture), as engine start-ups dominate the suite's time (~30 s for the first in a process, a few seconds after).

The folder is not named ``vllm``: pytest puts ``tests/`` on ``sys.path``, where a ``vllm`` folder would pass for a
missing vLLM (as a namespace package)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf_tiny():
    """``(model, tokenizer)``: ``tiny-vllm`` loaded by transformers (fp32, eval), the weights the engines load."""
    from lit_llm.models import load_model

    return load_model("tiny-vllm")
