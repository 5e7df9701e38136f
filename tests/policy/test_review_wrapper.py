"""Regression tests from a review of the policy wrapper (issue 3): versions, bad input, generate_kwargs types."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import ChatHistory, Masks, Tokens
from lit_llm.data.history import History
from lit_llm.models import tiny_model
from lit_llm.policy import TransformersWrapper
from lit_llm.policy.generation import validate_generate_kwargs


def _tokens_td(rows: list[list[int]], key: str = "prompt") -> TensorDict:
    items = [Tokens(**{key: torch.tensor(r)}, padded=False) for r in rows]
    return TensorDict(tokens=lazy_stack(items), batch_size=[len(rows)])


def test_get_new_version_num_samples_of_a_default_policy(tiny, tokenizer):
    # inplace=None resolves to True without num_samples; that resolved value used to be carried over, so
    # get_new_version(num_samples=n) raised "inplace=True cannot hold num_samples responses".
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 2})
    assert pol.inplace is True
    many = pol.get_new_version(num_samples=2)
    assert many.inplace is False and many.num_samples == 2
    out = many(_tokens_td([[1, 2, 3], [4, 5]]))
    assert out.batch_size == torch.Size([2, 2])
    assert out["tokens"][1, 0].prompt.tolist() == [4, 5] and out["tokens"][1, 1].prompt.tolist() == [4, 5]
    back = many.get_new_version(num_samples=None)
    assert back.inplace is True and back.num_samples is None
    # an explicit inplace is still carried over
    assert pol.get_new_version(inplace="empty").get_new_version(generate=True).inplace == "empty"


def test_log_prob_version_rejects_sequences_longer_than_the_context(tokenizer):
    model = tiny_model(tokenizer, max_position_embeddings=16)
    lp = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False)
    td = _tokens_td([list(range(100, 117))], key="full")
    with pytest.raises(ValueError, match=r"^TransformersWrapper \(log-prob version\): tokens.full row 0 has 17 tokens, "
                                         r"which exceeds the model's context of 16 tokens. Truncate or drop"):
        lp(td)
    assert lp(_tokens_td([list(range(100, 116))], key="full"))["log_probs"][0].full.shape == (16,)


def test_ids_outside_the_vocabulary_are_named(tiny, tokenizer):
    vocab = len(tokenizer)
    gen = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 2})
    with pytest.raises(ValueError, match=rf"^generate: prompt row 1 holds id {vocab} at position 2, outside the "
                                         rf"model's vocabulary \[0, {vocab}\)\. Tokenize with the model's own"):
        gen(_tokens_td([[1, 2], [3, 4, vocab]]))
    lp = gen.get_new_version(generate=False)
    with pytest.raises(ValueError, match=r"tokens.full row 0 holds id -1 at position 0, outside"):
        lp(_tokens_td([[-1, 2]], key="full"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": "0.7"}, "temperature must be a real number (or None), got '0.7'"),
    ({"temperature": float("nan")}, "temperature must be a real number (or None), got nan"),
    ({"top_p": True}, "top_p must be a real number (or None), got True"),
    ({"top_k": 2.5}, "top_k must be an integer (or None), got 2.5"),
    ({"max_new_tokens": 8.0}, "max_new_tokens must be an integer (or None), got 8.0"),
    ({"do_sample": "yes"}, "do_sample must be a bool (or None), got 'yes'"),
])
def test_generate_kwargs_types(kwargs, message):
    # these used to raise a bare TypeError ('<' between str and int) or pass silently (NaN -> greedy, top_k=2.5)
    with pytest.raises(ValueError, match="^generate_kwargs: " + message.replace("(", r"\(").replace(")", r"\)")):
        validate_generate_kwargs(kwargs)


def test_generate_kwargs_numpy_scalars_pass():
    np = pytest.importorskip("numpy")
    validate_generate_kwargs({"temperature": np.float32(0.7), "top_k": np.int64(5), "max_new_tokens": np.int64(3)})


def _full_history_td(convs) -> TensorDict:
    return TensorDict(history=ChatHistory(full=History.from_chats(convs), batch_size=[len(convs)]),
                      batch_size=[len(convs)])


def test_sft_dist_ends_at_the_stop_token_not_the_separator(tiny, tokenizer):
    # ChatML renders "\n" after <|im_end|>; the model never generates it (generation stops at <|im_end|>), so the
    # SFT mask must end at the stop token (DESIGN.md property 5), like the datasets' response_mask.
    convs = [[{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
             [{"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "Blue"},
              {"role": "user", "content": "Another"}, {"role": "assistant", "content": "Red"}]]
    lp = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False)
    dist = lp.get_sft_dist(_full_history_td(convs))
    got = [tokenizer.decode(dist.tokens[b][dist.mask[b]]) for b in range(2)]
    assert got == ["4<|im_end|>", "Red<|im_end|>"]
    rlhf = lp.get_rlhf_dist(_full_history_td(convs))
    assert [tokenizer.decode(rlhf.tokens[b][rlhf.mask[b]]) for b in range(2)] == ["4<|im_end|>",
                                                                                  "Blue<|im_end|>Red<|im_end|>"]


def test_sft_dist_of_generated_output_is_the_response(tiny, tokenizer):
    gen = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 3})
    h = History.from_chats([[{"role": "user", "content": "Hi"}]])
    out = gen(TensorDict(history=ChatHistory(prompt=h, batch_size=[1]), batch_size=[1]))
    dist = gen.get_new_version(generate=False).get_sft_dist(out)
    assert torch.equal(dist.tokens[0][dist.mask[0]], out["tokens"][0].response)


def test_sft_dist_rejects_a_conversation_ending_with_a_user_message(tiny, tokenizer):
    # used to raise a misleading PrefixMismatchError ("the template renders earlier turns differently")
    convs = [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
              {"role": "user", "content": "c"}]]
    lp = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False)
    with pytest.raises(ValueError, match=r"^get_sft_dist: row 0 of \('history', 'full'\) ends with a 'user' message; "
                                         r"the SFT head trains on the final assistant reply"):
        lp.get_sft_dist(_full_history_td(convs))


def test_get_new_version_rederives_temperature_and_num_samples_from_new_generate_kwargs(tiny, tokenizer):
    # The resolved log-prob temperature used to be carried over: a version sampling at 1.3 scored at 0.7.
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"temperature": 0.7})
    assert pol.get_new_version(generate=False).temperature == 0.7
    hot = pol.get_new_version(generate_kwargs={"temperature": 1.3})
    assert hot.generation_config.temperature == 1.3
    assert hot.temperature == 1.3 and hot.get_new_version(generate=False).temperature == 1.3
    assert pol.get_new_version(generate_kwargs={"do_sample": False}).temperature == 1.0
    pinned = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"temperature": 0.7}, temperature=2.0)
    assert pinned.get_new_version(generate_kwargs={"temperature": 1.3}).temperature == 2.0
    # num_samples derived from n used to conflict with a new n
    two = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"n": 2})
    assert two.num_samples == 2 and two.get_new_version(generate_kwargs={"n": 3}).num_samples == 3
    assert two.get_new_version(generate=False).get_new_version(generate=True).num_samples == 2
    four = TransformersWrapper(tiny, tokenizer=tokenizer, num_samples=4)
    assert four.get_new_version(pad_output=True).num_samples == 4


def test_log_prob_version_reads_a_custom_input_key_in_tokens_mode(tiny, tokenizer):
    # input_key was ignored by the log-prob version in tokens mode ("the input has no ('my', 'ids')" while present)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    custom = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False,
                                 input_key=("my", "ids"))
    got = custom(TensorDict({("my", "ids"): ids}, batch_size=[2])).get(("log_probs", "full"), as_list=True)
    plain = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    ref = plain(_tokens_td(ids.tolist(), key="full")).get(("log_probs", "full"), as_list=True)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=0, rtol=0)


def test_padded_ids_without_attention_mask_raise(tiny, tokenizer):
    # pad == eos (<|im_end|>, id 2): left padding used to be scored (or prompted) as real <|im_end|> tokens.
    padded = torch.tensor([[2, 2, 5, 6, 7], [8, 9, 10, 11, 12]])
    lp = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    with pytest.raises(ValueError, match=r"^TransformersWrapper\(generate=False\): \('tokens', 'full'\) is padded "
                                         r"\(tokens.padded=True\) without \('masks', 'all_attention_mask'\)"):
        lp(TensorDict(tokens=Tokens(full=padded, padded=True, batch_size=[2]), batch_size=[2]))
    gen = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"\('tokens', 'prompt'\) is padded \(tokens.padded=True\) without "
                                         r"\('masks', 'all_attention_mask'\) or 'attention_mask'"):
        gen(TensorDict(tokens=Tokens(prompt=padded, padded=True, batch_size=[2]), batch_size=[2]))
    # with the attention mask the padding is dropped: same numbers as the unpadded rows
    attn = torch.tensor([[False, False, True, True, True], [True] * 5])
    td = TensorDict(tokens=Tokens(full=padded, padded=True, batch_size=[2]),
                    masks=Masks(all_attention_mask=attn, padded=True, batch_size=[2]), batch_size=[2])
    got = lp(td).get(("log_probs", "full"), as_list=True)
    ref = lp(_tokens_td([[5, 6, 7], [8, 9, 10, 11, 12]], key="full")).get(("log_probs", "full"), as_list=True)
    assert [g.numel() for g in got] == [3, 5]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=0)
