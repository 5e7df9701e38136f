"""generate_kwargs standardisation, validation and resolution (issue 3), with the messages asserted."""

from __future__ import annotations

import pytest

from lit_llm.policy import TransformersWrapper
from lit_llm.policy.generation import (
    SUPPORTED_GENERATE_KWARGS,
    resolve_generation_config,
    standardize_generate_kwargs,
    validate_generate_kwargs,
)


def test_legacy_names_are_renamed():
    assert standardize_generate_kwargs({"max_tokens": 7, "n": 3, "top_k": 5}) == {
        "max_new_tokens": 7, "num_return_sequences": 3, "top_k": 5}
    assert standardize_generate_kwargs(None) == {}


def test_legacy_name_wins_on_conflict_with_warning():
    with pytest.warns(UserWarning, match=r"both 'max_tokens'=4 and 'max_new_tokens'=9 were given; the legacy name"):
        out = standardize_generate_kwargs({"max_tokens": 4, "max_new_tokens": 9})
    assert out == {"max_new_tokens": 4}
    with pytest.warns(UserWarning, match=r"both 'n'=2 and 'num_return_sequences'=5"):
        assert standardize_generate_kwargs({"n": 2, "num_return_sequences": 5}) == {"num_return_sequences": 2}


def test_input_dict_not_modified():
    kw = {"max_tokens": 4}
    standardize_generate_kwargs(kw)
    assert kw == {"max_tokens": 4}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, "temperature must be non-negative, got -0.5"),
    ({"top_p": 1.5}, "top_p must be between 0 and 1, got 1.5"),
    ({"top_p": -0.1}, "top_p must be between 0 and 1, got -0.1"),
    ({"top_k": 0}, "top_k must be positive, got 0"),
    ({"top_k": -3}, "top_k must be positive, got -3"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be positive, got 0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be positive, got -1.0"),
    ({"do_sample": False, "temperature": 0.7}, "do_sample=False (greedy decoding) contradicts temperature=0.7"),
    ({"do_sample": True, "temperature": 0}, "do_sample=True with temperature=0 cannot sample"),
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
    ({"n": 0}, "num_return_sequences must be a positive integer, got 0"),
    ({"min_p": 2.0}, "min_p must be between 0 and 1, got 2.0"),
    ({"beam_size": 4}, "unsupported key(s) ['beam_size']"),
])
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        standardize_generate_kwargs(kwargs)
    assert message in str(err.value)
    assert str(err.value).startswith("generate_kwargs:")


@pytest.mark.parametrize("kwargs", [
    {"top_k": None}, {"top_p": 0.0}, {"top_p": 1.0}, {"do_sample": False, "temperature": 0},
    {"do_sample": False}, {"temperature": 0.0}, {"repetition_penalty": 1.3}, {"min_p": 0.0},
])
def test_valid_settings_pass(kwargs):
    validate_generate_kwargs(kwargs)


def test_wrapper_raises_the_same_errors(tiny, tokenizer):
    with pytest.raises(ValueError, match=r"generate_kwargs: top_p must be between 0 and 1, got 2"):
        TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"top_p": 2})
    with pytest.raises(ValueError, match=r"contradicts temperature=1.0"):
        TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"do_sample": False, "temperature": 1.0})


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeModel:
    def __init__(self, gen_eos, cfg_eos=None, max_new_tokens=None):
        self.generation_config = _Cfg(eos_token_id=gen_eos, pad_token_id=None, max_new_tokens=max_new_tokens)
        self.config = _Cfg(eos_token_id=cfg_eos, pad_token_id=None)


def test_resolve_defaults_and_eos_lists():
    cfg = resolve_generation_config({}, _FakeModel([2, 7]))
    assert cfg.eos_token_ids == (2, 7)
    assert cfg.pad_token_id == 2  # falls back to the first eos id
    assert cfg.do_sample is False and cfg.temperature == 1.0 and cfg.max_new_tokens == 128
    assert cfg.top_k is None and cfg.top_p is None and cfg.repetition_penalty is None
    cfg = resolve_generation_config({"temperature": 0.7, "eos_token_id": 5, "max_tokens": 3}, _FakeModel(2))
    assert (cfg.do_sample, cfg.temperature, cfg.eos_token_ids, cfg.max_new_tokens) == (True, 0.7, (5,), 3)
    # greedy: reported log-probs at temperature 1, whatever "temperature=0" says
    assert resolve_generation_config({"temperature": 0}, _FakeModel(2)).temperature == 1.0
    assert resolve_generation_config({}, _FakeModel(None, cfg_eos=9, max_new_tokens=11)).eos_token_ids == (9,)
    assert resolve_generation_config({}, _FakeModel(4, max_new_tokens=11)).max_new_tokens == 11


def test_resolve_without_any_eos_raises():
    with pytest.raises(ValueError, match=r"no eos_token_id in generate_kwargs, model.generation_config"):
        resolve_generation_config({}, _FakeModel(None))


def test_num_samples_from_n(tiny, tokenizer):
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"n": 3, "temperature": 1.0})
    assert pol.num_samples == 3 and pol.inplace is False
    with pytest.raises(ValueError, match=r"num_samples=2 contradicts generate_kwargs num_return_sequences/n=3"):
        TransformersWrapper(tiny, tokenizer=tokenizer, num_samples=2, generate_kwargs={"n": 3})


def test_supported_keys_listed():
    assert {"max_new_tokens", "temperature", "top_k", "top_p", "do_sample"} <= SUPPORTED_GENERATE_KWARGS
