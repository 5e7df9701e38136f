"""Every TorchRL ``get_dist`` / ``_get_*_dist`` argument is honoured or rejected naming it (issue 12, item 2)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from lit_llm.data.containers import ChatHistory
from lit_llm.data.history import History
from lit_llm.policy import TransformersWrapper

ATTN = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1],
                     [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # row 0 left-, row 1 right-padded
ASST = torch.tensor([[0, 0, 0, 0, 1, 1, 0, 1],
                     [0, 0, 1, 1, 0, 1, 0, 0]], dtype=torch.bool)
GENERIC = ATTN & (ATTN.long().cumsum(-1) > 1)
OTHER = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0],
                      [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
PROMPT = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)


def lpv(tiny, tokenizer, mode="tokens"):
    return TransformersWrapper(tiny, tokenizer=tokenizer, input_mode=mode, generate=False)


def dense_td():
    ids = torch.arange(100, 116).reshape(2, 8)
    ids[~ATTN] = 2
    return TensorDict({("tokens", "full"): ids, ("masks", "all_attention_mask"): ATTN,
                       ("masks", "all_assistant_mask"): ASST, "other": OTHER, "prompt_m": PROMPT}, batch_size=[2])


def history_td():
    hist = History.from_chats([[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}],
                               [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]])
    return TensorDict(history=ChatHistory(full=hist, batch_size=[2]), batch_size=[2])


@pytest.mark.parametrize(("kwargs", "arg"), [
    ({"logits_key": "does_not_exist"}, "logits_key"),
    ({"as_nested_tensor": True}, "as_nested_tensor"),
    ({"as_padded_tensor": False}, "as_padded_tensor"),
    ({"padding_value": -1.0}, "padding_value"),
    ({"layout": torch.jagged}, "layout"),
    ({"tensordict_out": TensorDict()}, "tensordict_out"),
    ({"padding_side": "middle"}, "padding_side"),
])
@pytest.mark.parametrize("method", ["get_dist", "_get_dist_with_attention_mask", "_get_rlhf_dist", "_get_sft_dist",
                                    "_get_dist_with_custom_mask"])
def test_unsupported_values_are_rejected_naming_the_argument(tiny, tokenizer, kwargs, arg, method):
    policy = lpv(tiny, tokenizer)
    args = (GENERIC,) if method == "_get_dist_with_custom_mask" else ()
    with pytest.raises(ValueError, match=rf"{arg}=.* not supported: "):
        getattr(policy, method)(dense_td(), *args, **kwargs)


def test_the_issue_call_is_rejected(tiny, tokenizer):
    policy = lpv(tiny, tokenizer, "history")
    with pytest.raises(ValueError, match="not supported"):
        policy.get_dist(history_td(), padding_side="right", as_nested_tensor=True, logits_key="does_not_exist")
    with pytest.raises(ValueError, match=r"assistant_mask_key \('nope', 'x'\) is not a dense mask"):
        policy._get_rlhf_dist(history_td(), assistant_mask_key=("nope", "x"))


@pytest.mark.parametrize("method", ["get_dist", "get_sft_dist", "_get_rlhf_dist", "_get_dist_with_attention_mask",
                                    "_get_dist_with_prompt_mask"])
def test_unknown_keywords_are_a_type_error(tiny, tokenizer, method):
    with pytest.raises(TypeError, match="bogus"):
        getattr(lpv(tiny, tokenizer), method)(dense_td(), bogus=1)


def test_default_values_are_accepted_and_change_nothing(tiny, tokenizer):
    policy, td = lpv(tiny, tokenizer), dense_td()
    base = policy.get_dist(td)
    dist = policy.get_dist(td, logits_key="logits", as_padded_tensor=True, as_nested_tensor=False, padding_value=0.0,
                           layout=torch.strided, tensordict_out=None)
    assert torch.equal(dist.mask, base.mask) and torch.equal(dist.mask, GENERIC)
    torch.testing.assert_close(dist.log_prob(dist.tokens), base.log_prob(base.tokens))
    assert torch.equal(policy._get_rlhf_dist(td, assistant_mask_key=("masks", "all_assistant_mask"),
                                             logits_key="logits", padding_side=None).mask, ASST & GENERIC)


def test_mask_keys_are_read_from_the_input(tiny, tokenizer):
    policy, td = lpv(tiny, tokenizer), dense_td()
    assert torch.equal(policy._get_rlhf_dist(td, assistant_mask_key="other").mask, OTHER & GENERIC)
    assert torch.equal(policy._get_dist_with_attention_mask(td, attention_mask_key="other").mask, OTHER & GENERIC)
    assert torch.equal(policy.get_dist(td, mask_key="other").mask, OTHER & GENERIC)
    # prompt mask: every scorable token after it
    assert torch.equal(policy._get_sft_dist(td, prompt_mask_key="prompt_m").mask, GENERIC & ~PROMPT)
    # a different assistant mask changes the SFT response (last run of assistant tokens)
    last_other = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool) & GENERIC
    assert torch.equal(policy._get_sft_dist(td, assistant_mask_key="other").mask, last_other)
    # attention_mask_key restricts the SFT positions
    sft = policy._get_sft_dist(td).mask
    assert sft.any() and torch.equal(policy._get_sft_dist(td, attention_mask_key="other").mask, sft & OTHER)
    for method, arg in [("_get_rlhf_dist", "assistant_mask_key"), ("_get_generic_dist", "attention_mask_key"),
                        ("_get_sft_dist", "prompt_mask_key"), ("_get_sft_dist", "assistant_mask_key"),
                        ("_get_sft_dist", "attention_mask_key"), ("get_dist", "mask_key")]:
        with pytest.raises(ValueError, match=rf"{arg}.*\('nope', 'x'\)"):
            getattr(policy, method)(td, **{arg: ("nope", "x")})
    with pytest.raises(ValueError, match=r"tokens_key=\('tokens', 'other'\) not supported"):
        policy._get_dist_with_prompt_mask(td, tokens_key=("tokens", "other"))
    # the default tokens_key is accepted
    assert torch.equal(policy._get_dist_with_prompt_mask(td, tokens_key=("tokens", "prompt")).mask, sft)


def test_custom_mask_is_get_dist_with_mask(tiny, tokenizer):
    policy, td = lpv(tiny, tokenizer), dense_td()
    dist = policy._get_dist_with_custom_mask(td, OTHER)
    assert torch.equal(dist.mask, OTHER & GENERIC) and torch.equal(dist.tokens, td["tokens", "full"])
    torch.testing.assert_close(dist.log_prob(dist.tokens), policy.get_dist(td, mask=OTHER).log_prob(dist.tokens))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_side_repads_the_dist(tiny, tokenizer, side):
    policy, td = lpv(tiny, tokenizer), dense_td()
    base = policy.get_dist(td, mask_key="other")
    base_lp = base.log_prob(base.tokens)
    dist = policy._get_dist_with_custom_mask(td, OTHER, padding_side=side)
    lp = dist.log_prob(dist.tokens)
    for b in range(2):
        n = int(ATTN[b].sum())
        block = slice(0, n) if side == "right" else slice(8 - n, 8)
        assert torch.equal(dist.tokens[b, block], td["tokens", "full"][b][ATTN[b]])
        assert torch.equal(dist.mask[b, block], base.mask[b][ATTN[b]]) and int(dist.mask[b].sum()) == int(
            base.mask[b].sum())
        torch.testing.assert_close(lp[b, block], base_lp[b][ATTN[b]])


def test_padding_side_on_history_input(tiny, tokenizer):
    policy, td = lpv(tiny, tokenizer, "history"), history_td()
    left = policy._get_rlhf_dist(td)
    right = policy._get_rlhf_dist(td, padding_side="right")
    assert right.mask.shape == left.mask.shape and int(right.mask.sum()) == int(left.mask.sum()) > 0
    assert torch.equal(right.tokens[left.tokens != right.tokens].sort().values,
                       left.tokens[left.tokens != right.tokens].sort().values) or torch.equal(left.tokens, right.tokens)
    torch.testing.assert_close(right.log_prob(right.tokens).sum(-1), left.log_prob(left.tokens).sum(-1))
    assert torch.equal(policy._get_rlhf_dist(td, padding_side="left").mask, left.mask)
