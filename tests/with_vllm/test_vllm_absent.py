"""Default suite (no vLLM needed): vLLMWrapper without vLLM is one error naming ``make setup-vllm``, the ``tiny-vllm``
folder (head size 32) is deterministic, and the vLLM engine helpers check their options before importing vLLM."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from lit_llm import models
from lit_llm.policy import vLLMWrapper
from lit_llm.policy.vllm_engine import load_weights, make_engine

HINT = "install it with `make setup-vllm` (its own virtualenv .venv-vllm) and run with .venv-vllm/bin/python."


@pytest.fixture
def no_vllm(monkeypatch):
    """``import vllm`` fails, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.mark.parametrize("model", ["tiny-vllm", "/no/such/folder", torch.nn.Linear(2, 2)])
def test_without_vllm_the_wrapper_is_one_error_naming_the_make_target(no_vllm, model):
    with pytest.raises(ImportError) as e:
        vLLMWrapper(model)
    message = str(e.value)
    assert message.startswith("vLLMWrapper needs vLLM, which is not importable here (") and message.endswith(HINT)
    assert "\n" not in message


def test_without_vllm_make_engine_checks_options_first_then_names_the_make_target(no_vllm):
    with pytest.raises(ValueError, match=r"^kv_cache_gib: expected a size in GiB > 0 \(or None for vLLM's own "
                                         r"rule\), got 0\.$"):
        make_engine("tiny-vllm", kv_cache_gib=0)
    with pytest.raises(ValueError, match=r"^logprobs_mode='raw_logprobs': the wrapper reports"):
        make_engine("tiny-vllm", logprobs_mode="raw_logprobs")
    with pytest.raises(ImportError, match=r"^make_engine needs vLLM, which is not importable here"):
        make_engine("tiny-vllm")
    with pytest.raises(ValueError, match=r"^load_weights: expected a vllm\.LLM, got Linear\.$"):
        load_weights(torch.nn.Linear(2, 2), [])


def test_without_vllm_use_vllm_is_one_error_at_construction(no_vllm):
    """Before any model load, logger folder or engine start; checked without importing vLLM."""
    from lit_llm.lightning.grpo import GRPOModule

    with pytest.raises(ValueError) as e:
        GRPOModule("tiny-vllm", num_generations=2, use_vllm=True)
    assert str(e.value) == (f"GRPOModule: use_vllm needs vLLM, which is not installed in this Python environment "
                            f"({sys.prefix}); install it with `make setup-vllm` (its own virtualenv .venv-vllm) and "
                            f"run .venv-vllm/bin/lit-llm (or .venv-vllm/bin/python).")


def test_tiny_vllm_is_a_saved_folder_with_head_size_32_and_seeded_weights(tokenizer):
    path = models.resolve_model_path("tiny-vllm")
    assert path == str(models.tiny_vllm_path())
    config = json.loads((models.tiny_vllm_path() / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    model, tok = models.load_model("tiny-vllm")
    assert len(tok) == len(tokenizer) == model.config.vocab_size
    want = models.tiny_model(tokenizer, **models.TINY_VLLM_ARCH).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
