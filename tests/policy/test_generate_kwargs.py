"""generate_kwargs standardisation, validation and resolution (issue 3), with the messages asserted; the processing
settings of issue 12 item 3 (stop strings, min_new_tokens, repetition penalty, no-repeat-n-gram, skip_special_tokens)
checked against transformers' own generate and full decodes."""

from __future__ import annotations

import copy

import pytest
import torch

from lit_llm.policy import TransformersWrapper
from lit_llm.policy.generation import (
    PREFIX_DEPENDENT_GENERATE_KWARGS,
    SUPPORTED_GENERATE_KWARGS,
    UNSUPPORTED_GENERATE_KWARGS,
    generate_tokens,
    prefix_dependent_settings,
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
    ({"num_beams": 4}, "num_beams=4 is not supported: beam search is not supported"),
    ({"length_penalty": 1.2}, "'length_penalty' is not supported: beam search is not supported"),
    ({"early_stopping": True}, "'early_stopping' is not supported: beam search"),
    ({"logprobs": True}, "'logprobs' is not supported: the wrapper returns per-token log-probs itself"),
    ({"output_scores": True}, "'output_scores' is not supported"),
    ({"stop_sequences": ["ok", ""]}, "stop_sequences must be a non-empty string or a list of non-empty strings"),
    ({"stop_sequences": 3}, "stop_sequences must be a non-empty string"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens must be a bool, got 'yes'"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be a non-negative integer (0 = off), got -1"),
    ({"min_new_tokens": 1.5}, "min_new_tokens must be a non-negative integer"),
    ({"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens=5 exceeds max_new_tokens=3"),
])
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        standardize_generate_kwargs(kwargs)
    assert message in str(err.value)
    assert str(err.value).startswith("generate_kwargs:")


@pytest.mark.parametrize("kwargs", [
    {"top_k": None}, {"top_p": 0.0}, {"top_p": 1.0}, {"do_sample": False, "temperature": 0},
    {"do_sample": False}, {"temperature": 0.0}, {"repetition_penalty": 1.3}, {"min_p": 0.0},
    {"num_beams": 1}, {"stop_sequences": "\n\n"}, {"stop_sequences": ["a", "bc"]}, {"skip_special_tokens": True},
    {"no_repeat_ngram_size": 0}, {"min_new_tokens": 2, "max_new_tokens": 2},
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


def test_resolved_processing_settings_and_prefix_dependent_names():
    cfg = resolve_generation_config({"stop_sequences": "END", "no_repeat_ngram_size": 0, "min_new_tokens": 0},
                                    _FakeModel(2))
    assert (cfg.stop_sequences, cfg.no_repeat_ngram_size, cfg.min_new_tokens) == (("END",), None, 0)
    assert prefix_dependent_settings(cfg) == []
    cfg = resolve_generation_config({"min_new_tokens": 2, "repetition_penalty": 1.2, "no_repeat_ngram_size": 3,
                                     "top_k": 5, "temperature": 0.7, "skip_special_tokens": True}, _FakeModel(2))
    assert prefix_dependent_settings(cfg) == ["repetition_penalty", "no_repeat_ngram_size", "min_new_tokens"]
    assert set(prefix_dependent_settings(cfg)) == set(PREFIX_DEPENDENT_GENERATE_KWARGS)
    assert cfg.skip_special_tokens is True
    with pytest.raises(ValueError, match=r"min_new_tokens=200 exceeds max_new_tokens=128 \(from the model"):
        resolve_generation_config({"min_new_tokens": 200}, _FakeModel(2))
    assert not set(UNSUPPORTED_GENERATE_KWARGS) & SUPPORTED_GENERATE_KWARGS


# ------------------------------------------------------------------------------- processing on the tiny model
_PROMPTS = [torch.tensor([1, 503, 2050, 17, 503, 2050]), torch.tensor([44, 45]), torch.tensor([9, 9, 9, 9, 9])]


def _hf_greedy(model, prompt: torch.Tensor, eos_token_id: int | None = None, **kw) -> list[int]:
    """transformers' own ``generate`` on one unpadded row (the independent reference); no eos stop by default."""
    out = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=0, **kw)
    return out[0, prompt.numel():].tolist()


@pytest.mark.parametrize("kw", [{"repetition_penalty": 1.8}, {"no_repeat_ngram_size": 2},
                                {"repetition_penalty": 0.5, "no_repeat_ngram_size": 1}])
def test_prefix_processors_match_transformers_per_row_in_a_padded_batch(tiny, kw):
    """Left-padded ragged rows decode as transformers' generate decodes each row alone: padding never counts."""
    never = tiny.config.vocab_size - 1  # an eos id the model never picks: every row runs max_new_tokens steps
    cfg = resolve_generation_config({"max_new_tokens": 8, "eos_token_id": never, **kw}, tiny)
    out = generate_tokens(tiny, _PROMPTS, cfg)
    plain = generate_tokens(tiny, _PROMPTS, resolve_generation_config({"max_new_tokens": 8, "eos_token_id": never},
                                                                       tiny))
    changed = False
    for b, p in enumerate(_PROMPTS):
        assert out.response_ids[b].tolist() == _hf_greedy(tiny, p, max_new_tokens=8, **kw)
        changed |= out.response_ids[b].tolist() != plain.response_ids[b].tolist()
        # reported log-probs: the unprocessed distribution of the ids actually chosen
        full = torch.cat([p, out.response_ids[b]])
        with torch.no_grad():
            ref = torch.log_softmax(tiny(full[None]).logits[0, p.numel() - 1:-1].float(), -1)
        torch.testing.assert_close(out.response_log_probs[b], ref.gather(1, out.response_ids[b][:, None])[:, 0],
                                   atol=1e-5, rtol=0)
    assert changed  # the setting did something on these prompts
    if "no_repeat_ngram_size" in kw:
        n = kw["no_repeat_ngram_size"]
        for b, p in enumerate(_PROMPTS):
            seq = torch.cat([p, out.response_ids[b]]).tolist()
            grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
            new = grams[len(p) - n + 1:] if len(p) >= n else grams
            assert all(grams.count(g) == 1 for g in new)


@pytest.fixture(scope="module")
def eos_loving(tiny):
    """The tiny model with a +1e4 bias on the eos logit (<|im_end|> = 2): greedy emits eos at once unless masked."""
    model = copy.deepcopy(tiny)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(tiny.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[2] = 1e4
    model.lm_head = head
    return model


def test_min_new_tokens_masks_eos_until_reached(eos_loving):
    p = torch.tensor([44, 45, 46])
    base = generate_tokens(eos_loving, [p], resolve_generation_config({"max_new_tokens": 6}, eos_loving))
    assert base.response_ids[0].tolist() == [2] and not bool(base.truncated[0])
    cfg = resolve_generation_config({"max_new_tokens": 6, "min_new_tokens": 3}, eos_loving)
    out = generate_tokens(eos_loving, [p, torch.tensor([7])], cfg)
    for b, prompt in enumerate([p, torch.tensor([7])]):
        ids = out.response_ids[b].tolist()
        assert ids == _hf_greedy(eos_loving, prompt, 2, max_new_tokens=3, min_new_tokens=3) + [2]
        assert 2 not in ids[:3] and len(ids) == 4 and not bool(out.truncated[b])


def _first_completion(tokenizer, ids: list[int], stop: str) -> int:
    """Index of the first token whose decoded prefix contains ``stop`` (full decode each time: the reference)."""
    return next(j for j in range(len(ids)) if stop in tokenizer.decode(ids[:j + 1], skip_special_tokens=False))


def test_stop_sequences_end_at_the_completing_token(tiny, tokenizer):
    never = tiny.config.vocab_size - 1
    prompts = [torch.tensor([1, 503, 2050, 17]), torch.tensor([44, 45])]
    long_cfg = resolve_generation_config({"max_new_tokens": 12, "eos_token_id": never}, tiny)
    free = generate_tokens(tiny, prompts, long_cfg)
    ids0 = free.response_ids[0].tolist()
    text0 = tokenizer.decode(ids0, skip_special_tokens=False)
    # a stop string straddling tokens 3 and 4 of row 0 (last char of token 3 + first char of token 4)
    t3 = tokenizer.decode(ids0[:4], skip_special_tokens=False)
    stop = t3[-1:] + text0[len(t3):len(t3) + 1]
    end0 = _first_completion(tokenizer, ids0, stop)
    cfg = resolve_generation_config({"max_new_tokens": 12, "eos_token_id": never, "stop_sequences": [stop]}, tiny)
    out = generate_tokens(tiny, prompts, cfg, tokenizer=tokenizer)
    assert out.response_ids[0].tolist() == ids0[:end0 + 1] and not bool(out.truncated[0])
    torch.testing.assert_close(out.response_log_probs[0], free.response_log_probs[0][:end0 + 1])
    ids1 = free.response_ids[1].tolist()
    if stop in tokenizer.decode(ids1, skip_special_tokens=False):
        end1 = _first_completion(tokenizer, ids1, stop)
        assert out.response_ids[1].tolist() == ids1[:end1 + 1]
    else:
        assert out.response_ids[1].tolist() == ids1 and bool(out.truncated[1])
    with pytest.raises(ValueError, match="stop_sequences need the tokenizer"):
        generate_tokens(tiny, prompts, cfg)
    # min_new_tokens: a stop string completed before it does not stop the row
    late = resolve_generation_config({"max_new_tokens": 12, "eos_token_id": never, "stop_sequences": [stop],
                                      "min_new_tokens": end0 + 2}, tiny)
    later = generate_tokens(tiny, prompts[:1], late, tokenizer=tokenizer)
    assert later.response_ids[0].tolist()[:end0 + 2] == ids0[:end0 + 2]


def test_stop_sequence_token_is_in_response_and_masks_history_mode(tiny, tokenizer):
    """DESIGN property 5 for stop strings: the completing token ends tokens.response and is in the assistant mask;
    the reply's History content keeps its text (it is not an eos token)."""
    from tensordict import TensorDict

    from lit_llm.data.containers import ChatHistory
    from lit_llm.data.history import History

    never = tiny.config.vocab_size - 1
    hist = History.from_chats([[{"role": "user", "content": "Count: 1 2 3"}]])
    td = TensorDict(history=ChatHistory(prompt=hist, batch_size=[1]), batch_size=[1])
    free = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 10,
                                                                           "eos_token_id": never})(td.copy())
    ids = free["tokens", "response"][0].tolist()
    text = tokenizer.decode(ids, skip_special_tokens=False)
    stop = text[len(tokenizer.decode(ids[:2])) - 1:len(tokenizer.decode(ids[:3]))]  # completed by token 2 (or before)
    end = _first_completion(tokenizer, ids, stop)
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={
        "max_new_tokens": 10, "eos_token_id": never, "stop_sequences": stop})
    out = pol(td.copy())
    resp = out["tokens", "response"][0]
    assert resp.tolist() == ids[:end + 1]
    assert out["truncated"].tolist() == [False]
    full, prompt = out["tokens", "full"][0], out["tokens", "prompt"][0]
    assert torch.equal(full, torch.cat([prompt, resp]))
    asst = out["masks", "all_assistant_mask"][0]
    assert asst[prompt.numel():].all() and asst.numel() == full.numel()
    assert out["log_probs", "response"][0].numel() == resp.numel()
    content = out["history", "response"][0].content
    content = content[0] if isinstance(content, list) else content
    assert content == tokenizer.decode(ids[:end + 1], skip_special_tokens=False)
    assert stop in content and out["text", "response"][0] == content


@pytest.mark.parametrize("skip", [False, True])
def test_skip_special_tokens_in_response_text_only(eos_loving, tokenizer, skip):
    pol = TransformersWrapper(eos_loving, tokenizer=tokenizer, input_mode="text", generate_kwargs={
        "max_new_tokens": 5, "min_new_tokens": 2, "skip_special_tokens": skip})
    from tensordict import TensorDict

    from lit_llm.data.containers import Text
    td = TensorDict(text=Text(prompt=["Hello there"], batch_size=[1]), batch_size=[1])
    out = pol(td)
    ids = out["tokens", "response"][0].tolist()
    assert len(ids) == 3 and ids[-1] == 2  # two tokens, then the (forced) eos: ids keep it either way
    body = tokenizer.decode(ids[:2], skip_special_tokens=False)
    assert "<|im_end|>" not in body
    assert out["text", "response"][0] == (body if skip else body + "<|im_end|>")
