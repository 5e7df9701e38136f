"""TorchRL parity basics (issue 12, items 1, 5 and 6) on the tiny model: ``log_prob`` on ragged batches with TorchRL's
get-kwargs, a model given as a string, float token ids, ``get_batching_state`` keys, cancellation error type; the
history-mode log-prob outputs, the ``return_*`` flags, one-message prompts, non-History input,
``chat_template_name``."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import Tokens
from lit_llm.policy import TransformersWrapper
from lit_llm.policy.batching import BatchingCancelledError


def _ref_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of one row scored alone (position 0 is 0)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def _ragged(prompts, responses=None) -> TensorDict:
    rows = []
    for i, p in enumerate(prompts):
        if responses is None:
            rows.append(Tokens(full=p, padded=False))
        else:
            rows.append(Tokens(prompt=p, response=responses[i], full=torch.cat([p, responses[i]]), padded=False))
    return TensorDict(tokens=lazy_stack(rows), batch_size=[len(rows)])


PROMPTS = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11, 12, 13])]
RESPONSES = [torch.tensor([20, 21]), torch.tensor([22, 23, 24, 25]), torch.tensor([26])]


# ----------------------------------------------------------------------------------------------------------- item 1
def test_log_prob_ragged_returns_response_rows(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    assert scorer.pad_output is False
    td = _ragged(PROMPTS, RESPONSES)
    lp = scorer.log_prob(td.copy())  # no kwargs: the ragged rows (not a stacking error)
    as_list = scorer.log_prob(td.copy(), as_list=True)
    assert isinstance(lp, list) and isinstance(as_list, list)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ref = _ref_log_probs(tiny, torch.cat([p, r]))[p.numel():]
        torch.testing.assert_close(lp[b], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(as_list[b], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_log_prob_padded_tensor_kwargs(tiny, tokenizer, side):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    td = _ragged(PROMPTS, RESPONSES)
    rows = scorer.log_prob(td.copy(), as_list=True)
    padded = scorer.log_prob(td.copy(), as_padded_tensor=True, padding_side=side, padding_value=-7.0)
    width = max(r.numel() for r in rows)
    assert padded.shape == (3, width)
    for b, r in enumerate(rows):
        n = r.numel()
        real, pad = (padded[b, width - n:], padded[b, :width - n]) if side == "left" else \
            (padded[b, :n], padded[b, n:])
        torch.testing.assert_close(real, r)
        assert (pad == -7.0).all()


def test_log_prob_falls_back_to_full_without_split(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    lp = scorer.log_prob(_ragged(PROMPTS))
    for b, p in enumerate(PROMPTS):
        torch.testing.assert_close(lp[b], _ref_log_probs(tiny, p), atol=1e-5, rtol=0)


def test_log_prob_padded_output_and_unknown_kwarg(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True)
    td = _ragged(PROMPTS, RESPONSES)
    lp = scorer.log_prob(td.copy())
    assert isinstance(lp, torch.Tensor) and lp.shape == (3, 4)  # response padded to the longest, on the right
    torch.testing.assert_close(lp[2, :1], _ref_log_probs(tiny, torch.cat([PROMPTS[2], RESPONSES[2]]))[4:],
                               atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['bogus'\\]"):
        scorer.log_prob(td.copy(), bogus=True)


def test_log_prob_refused_on_generate_version(tiny, tokenizer):
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=True)
    with pytest.raises(Exception, match="log_prob"):
        pol.log_prob(_ragged(PROMPTS))


# ----------------------------------------------------------------------------------------------------------- item 5
def test_model_string_unknown_refused_at_construction(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="cannot be loaded.*load_model"):
        TransformersWrapper(str(missing))


def test_model_string_local_folder_loads_model_and_tokenizer(tiny, tokenizer, tmp_path):
    tiny.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    pol = TransformersWrapper(str(tmp_path), input_mode="tokens", generate=False)
    assert isinstance(pol.model, torch.nn.Module) and pol.tokenizer is not None
    assert pol.device == torch.device("cpu")
    lp = pol.log_prob(_ragged(PROMPTS))
    torch.testing.assert_close(lp[0], _ref_log_probs(tiny, PROMPTS[0]), atol=1e-5, rtol=0)
    mine = TransformersWrapper(str(tmp_path), tokenizer=tokenizer, input_mode="tokens", generate=False)
    assert mine.tokenizer is tokenizer  # a given tokenizer wins


def test_model_not_a_module_refused(tokenizer):
    with pytest.raises(ValueError, match="torch.nn.Module"):
        TransformersWrapper(object(), tokenizer=tokenizer)


@pytest.mark.parametrize("generate", [False, True])
def test_float_token_ids_raise_naming_the_key(tiny, tokenizer, generate):
    key = "prompt" if generate else "full"
    td = TensorDict(tokens=lazy_stack([Tokens(**{key: torch.tensor([1.0, 2.5, 3.9])}, padded=False)]),
                    batch_size=[1])
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=generate,
                              generate_kwargs={"max_new_tokens": 2} if generate else None)
    with pytest.raises(ValueError, match=f"'tokens', '{key}'.*torch.float32.*integer"):
        pol(td)


def test_batching_state_torchrl_keys_and_cancel_error_type(tiny, tokenizer):
    assert issubclass(BatchingCancelledError, concurrent.futures.CancelledError)
    assert issubclass(BatchingCancelledError, RuntimeError)
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False, batching=True,
                              min_batch_size=8, batching_timeout=60.0)
    results: list = [None, None]

    def call(i):
        try:
            results[i] = pol(_ragged([PROMPTS[i]]))
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while pol.get_batching_state()["queue_size"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    state = pol.get_batching_state()
    for k in ("batching_enabled", "min_batch_size", "max_batch_size", "queue_size", "processing", "lock_state",
              "pending_futures", "timeout", "batching_timeout", "pending_requests"):
        assert k in state, k
    assert state["timeout"] == state["batching_timeout"] == 60.0
    assert state["pending_futures"] == state["pending_requests"] == 2
    assert state["lock_state"] == "unlocked" and state["processing"] is False
    pol.cleanup_batching(flush=False)
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    for r in results:
        assert isinstance(r, concurrent.futures.CancelledError) and isinstance(r, BatchingCancelledError)


# ----------------------------------------------------------------------------------------------------------- item 6
CONV = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
CONV_B = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+5?"},
          {"role": "assistant", "content": "8"}, {"role": "user", "content": "and 1+1?"},
          {"role": "assistant", "content": "2"}]


def _history_td(convs):
    from lit_llm.data.containers import ChatHistory
    from lit_llm.data.history import History

    return TensorDict(history=ChatHistory(full=History.from_chats(convs), batch_size=[len(convs)]),
                      batch_size=[len(convs)])


def test_history_log_prob_version_returns_text_history_and_the_response(tiny, tokenizer):
    from lit_llm.data.containers import ChatHistory
    from lit_llm.data.history import History

    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False)
    assert (scorer.return_text, scorer.return_history, scorer.return_tokens, scorer.return_masks) == (
        True, True, True, True)
    assert scorer.out_keys == ["text", "masks", "tokens", "log_probs", "history"]  # TorchRL's order
    out = scorer(_history_td([CONV, CONV_B]))
    for b, conv in enumerate([CONV, CONV_B]):
        ref = ChatHistory(full=History.from_chats(conv)).to_tokens(tokenizer)  # split at the last assistant turn
        assert out[b]["tokens", "full"].tolist() == ref.full.tolist()
        assert out[b]["tokens", "prompt"].tolist() == ref.prompt.tolist()
        assert out[b]["tokens", "response"].tolist() == ref.response.tolist()
        text = ChatHistory(full=History.from_chats(conv)).to_text(tokenizer)
        assert (out[b]["text"].full, out[b]["text"].prompt, out[b]["text"].response) == (
            text.full, None, None)  # text.full only, as TorchRL
        full_h = out[b]["history", "full"]  # the input row, "<none>"-padded to the batch's longest conversation
        assert [c for c, r in zip(full_h.content, full_h.role) if r != "<none>"] == [m["content"] for m in conv]
        assert list(out[b]["history", "response"].content) == [conv[-1]["content"]]
        assert list(out[b]["history", "prompt"].role) == [m["role"] for m in conv[:-1]]
        lp = _ref_log_probs(tiny, ref.full)[ref.prompt.numel():]
        torch.testing.assert_close(scorer.log_prob(_history_td([CONV, CONV_B]))[b], lp, atol=1e-5, rtol=0)
    assert tokenizer.decode(out[1]["tokens", "response"].tolist()) == "2<|im_end|>\n"


def test_return_flags_drop_outputs_and_are_validated(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False, return_text=False,
                                 return_history=False, return_masks=False)
    assert scorer.out_keys == ["tokens", "log_probs"]
    out = scorer(_history_td([CONV]))
    assert set(out.keys()) == {"history", "tokens", "log_probs"}  # the input's history, nothing new written there
    assert out[0]["history"].prompt is None and out[0]["history"].response is None  # the input, untouched
    assert scorer.get_new_version(generate=True).return_text is False  # flags are carried over
    tok_mode = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    assert (tok_mode.return_text, tok_mode.return_history) == (False, False)
    text_mode = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text", generate=False)
    assert text_mode.out_keys == ["text", "masks", "tokens", "log_probs"]
    with pytest.raises(ValueError, match="return_history=True needs input_mode='history'"):
        TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text", return_history=True)
    with pytest.raises(ValueError, match="return_text=True needs input_mode 'history' or 'text'"):
        TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", return_text=True)
    with pytest.raises(ValueError, match="return_masks must be a bool or None, got 1"):
        TransformersWrapper(tiny, tokenizer=tokenizer, return_masks=1)


def test_text_mode_log_prob_version_returns_text(tiny, tokenizer):
    from lit_llm.data.containers import Text

    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text", generate=False)
    full = "<|im_start|>user\nHi<|im_end|>\n"
    out = scorer(TensorDict(text=Text(full=[full, "abc"], batch_size=[2]), batch_size=[2]))
    assert out[0]["text", "full"] == full and out[1]["text", "full"] == "abc"


def test_single_message_prompts_generate(tiny, tokenizer):
    from lit_llm.data.containers import ChatHistory
    from lit_llm.data.history import History

    h = History.from_chats([[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}],
                            [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "y"}]])
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 3})
    with pytest.warns(UserWarning, match="one more batch dimension"):
        ch = ChatHistory(prompt=h[:, 0], batch_size=[2])
    out = pol(TensorDict(history=ch, batch_size=[2]))
    raw = TensorDict(batch_size=[2])
    raw["history", "prompt"] = h[:, 0]  # a [B] History set directly: one message per row, no ChatHistory
    out_raw = pol(raw)
    for b in range(2):
        single = History.from_chats([{"role": "user", "content": ["Hi", "Hello there"][b]}])
        ids = torch.as_tensor(single.apply_chat_template(tokenizer, add_generation_prompt=True, return_dict=False,
                                                         tokenize=True))
        assert out[b]["tokens", "prompt"].tolist() == ids.tolist() == out_raw[b]["tokens", "prompt"].tolist()
        assert list(out[b]["history", "full"].role) == ["user", "assistant"]


def test_non_history_input_raises_type_error(tiny, tokenizer):
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 2})
    td = TensorDict(batch_size=[1])
    td["history", "prompt"] = torch.zeros(1, 3)
    with pytest.raises(TypeError, match=r"input at \('history', 'prompt'\) must be a History .*got Tensor"):
        pol(td)
    scorer = pol.get_new_version(generate=False)
    td = TensorDict(batch_size=[1])
    td["history", "full"] = torch.zeros(1, 3)
    with pytest.raises(TypeError, match=r"input at \('history', 'full'\) must be a History"):
        scorer(td)


def test_wrapper_chat_template_name(tiny, tokenizer, templates_dir):
    from lit_llm.data.containers import ChatHistory
    from lit_llm.data.history import History

    named = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False, chat_template_name="chatml_format")
    # the packaged template by its name (TorchRL's chatml_format: no BOS, so no doubled <|im_start|> with SmolLM2's
    # tokenizer, whose bos_token is <|im_start|>)
    by_path = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False, chat_template="chatml")
    a, b = named(_history_td([CONV])), by_path(_history_td([CONV]))
    assert a[0]["tokens", "full"].tolist() == b[0]["tokens", "full"].tolist()
    assert tokenizer.decode(a[0]["tokens", "full"]).startswith("<|im_start|>user") \
        and "<|im_start|><|im_start|>" not in tokenizer.decode(a[0]["tokens", "full"])
    ref = ChatHistory(full=History.from_chats(CONV)).to_tokens(tokenizer)
    assert a[0]["tokens", "full"].tolist() != ref.full.tolist()  # not the tokenizer's own (SmolLM2 system prompt)
    assert named.get_new_version(generate=True).chat_template_name == "chatml_format"
    with pytest.raises(ValueError, match="pass chat_template or chat_template_name, not both"):
        TransformersWrapper(tiny, tokenizer=tokenizer, chat_template="x.jinja", chat_template_name="qwen")
