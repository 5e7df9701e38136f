"""TransformersWrapper on the tiny random model: generate/log-prob agreement, layouts, stopping, masks, versions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import ChatHistory, Text, Tokens
from lit_llm.data.history import History
from lit_llm.models import tiny_model
from lit_llm.policy import LLMWrapperBase, TransformersWrapper

PROMPTS = ["What is 2 + 2? Answer briefly please.", "Hi", "Name three colours of the rainbow."]


def _ref_log_probs(model, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Independent reference: one unpadded row through model(...).logits, log_softmax, gather; 0 at position 0."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(-1, ids[1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def _tokens_td(tokenizer, prompts=PROMPTS) -> TensorDict:
    rows = [Tokens(prompt=torch.tensor(tokenizer(p)["input_ids"]), padded=False) for p in prompts]
    return TensorDict(tokens=lazy_stack(rows), batch_size=[len(prompts)])


def _history_td(convs) -> TensorDict:
    h = History.from_chats(convs)
    return TensorDict(history=ChatHistory(prompt=h, batch_size=[len(convs)]), batch_size=[len(convs)])


CONVS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour of the sky at noon."}]]


# ------------------------------------------------------------------------------------- generate vs log-prob version
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_log_probs_match_teacher_forced(tiny, tokenizer, temperature):
    torch.manual_seed(0)
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens",
                              generate_kwargs={"max_new_tokens": 10, "temperature": temperature, "top_k": 50})
    out = pol(_tokens_td(tokenizer))
    prompts = out.get(("tokens", "prompt"), as_list=True)
    assert len({p.numel() for p in prompts}) == 3  # a left-padded batch of different lengths
    lpv = pol.get_new_version(generate=False)
    assert lpv.temperature == temperature and lpv.model is pol.model
    scored = lpv(out.copy())
    for b in range(3):
        full = out["tokens"][b].full
        resp = out["tokens"][b].response
        assert torch.equal(full, torch.cat([prompts[b], resp]))
        gen_lp = out["log_probs"][b].response
        tf_lp = scored["log_probs"][b].response
        torch.testing.assert_close(tf_lp, gen_lp, atol=1e-4, rtol=0)
        ref = _ref_log_probs(tiny, full, temperature)
        torch.testing.assert_close(gen_lp, ref[-resp.numel():], atol=1e-4, rtol=0)
        torch.testing.assert_close(scored["log_probs"][b].full, ref, atol=1e-4, rtol=0)
        # log_probs.full of the generate version: zeros over the prompt, then the response log-probs
        assert torch.equal(out["log_probs"][b].full[: prompts[b].numel()], torch.zeros(prompts[b].numel()))


def test_history_generate_then_log_prob_round_trip(tokenizer):
    model = tiny_model(tokenizer, seed=2)
    greedy = TransformersWrapper(model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 6})
    free = greedy(_history_td(CONVS))
    # make a later greedy token of row 0 a stop id (the model's generation config lists two eos ids)
    seqs = [free["tokens"][b].response.tolist() for b in range(2)]
    k = next((i for i in range(1, 6) if seqs[0][i] not in seqs[0][:i]), 0)
    stop = seqs[0][k]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    pol = TransformersWrapper(model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 6})
    out = pol(_history_td(CONVS))
    r0 = out["tokens"][0].response
    assert r0.tolist() == seqs[0][: k + 1]
    assert out["truncated"][0].item() is False
    h0 = out["history"][0]
    assert h0.response.role == ["assistant"] and h0.response.is_complete == [True]
    assert h0.response.content[0] == tokenizer.decode(r0[:-1].tolist())  # stop token text stripped, id kept
    assert h0.full.to_chats()[:1] == CONVS[0]
    assert out["text"][0].full == out["text"][0].prompt + out["text"][0].response
    assert out["text"][0].prompt == History.from_chats(CONVS[0]).apply_chat_template(
        tokenizer, add_generation_prompt=True, tokenize=False)

    lpv = pol.get_new_version(generate=False)
    assert lpv.in_keys == [("history", "full")]
    scored = lpv(out.copy())
    for b in range(2):
        full = out["tokens"][b].full
        assert torch.equal(scored["tokens"][b].full, full)  # same ids, never re-tokenised
        mask = scored["masks"][b].all_assistant_mask
        expected = torch.zeros(full.numel(), dtype=torch.bool)
        expected[out["tokens"][b].prompt.numel():] = True  # exactly the response, stop token included
        assert torch.equal(mask, expected)
        torch.testing.assert_close(scored["log_probs"][b].response, out["log_probs"][b].response, atol=1e-4, rtol=0)


def test_log_prob_version_from_history_only_chatml_mask(tiny, tokenizer):
    """tokens.full without masks: the render's mask is used; ChatML's trailing newline is not in tokens.full."""
    conv = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello!"}]
    prompt = History.from_chats(conv[:1]).apply_chat_template(tokenizer, add_generation_prompt=True,
                                                              return_dict=False, tokenize=True)
    reply = torch.tensor(tokenizer("Hello!", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
    full = torch.cat([prompt, reply])
    td = TensorDict(history=lazy_stack([ChatHistory(full=History.from_chats(conv))]),
                    tokens=lazy_stack([Tokens(full=full, padded=False)]), batch_size=[1])
    lpv = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False)
    out = lpv(td)
    expected = torch.zeros(full.numel(), dtype=torch.bool)
    expected[-reply.numel():] = True
    assert torch.equal(out["masks"][0].all_assistant_mask, expected)
    assert torch.equal(out["tokens"][0].full, full)
    # without tokens.full the render is used, trailing "\n" included (attended, not assistant)
    out2 = lpv(TensorDict(history=lazy_stack([ChatHistory(full=History.from_chats(conv))]), batch_size=[1]))
    f2 = out2["tokens"][0].full
    assert torch.equal(f2[:-1], full) and tokenizer.decode(f2[-1:]) == "\n"
    assert torch.equal(out2["masks"][0].all_assistant_mask, torch.cat([expected, torch.tensor([False])]))
    # the SFT distribution masks exactly the reply; its log_prob equals log_probs.full there
    dist = lpv.get_sft_dist(td)
    assert torch.equal(dist.mask[0], expected)
    torch.testing.assert_close(dist.log_prob(dist.tokens)[0], out["log_probs"][0].full * expected, atol=1e-5,
                               rtol=0)


# ------------------------------------------------------------------------------------- layouts
def test_padded_unpadded_single_row_identical(tiny, tokenizer):
    kw = dict(input_mode="tokens", generate_kwargs={"max_new_tokens": 5})
    unpadded = TransformersWrapper(tiny, tokenizer=tokenizer, **kw)(_tokens_td(tokenizer))
    padded = TransformersWrapper(tiny, tokenizer=tokenizer, pad_output=True, **kw)(_tokens_td(tokenizer))
    assert padded["tokens"].padded is True
    full_p, attn_p = padded["tokens"].full, padded["masks"].all_attention_mask
    lp_resp_p = padded["log_probs"].response
    for b, text in enumerate(PROMPTS):
        single = TransformersWrapper(tiny, tokenizer=tokenizer, **kw)(_tokens_td(tokenizer, [text]))
        u_full, s_full = unpadded["tokens"][b].full, single["tokens"][0].full
        assert torch.equal(full_p[b][attn_p[b]], u_full)
        assert attn_p[b, : full_p.shape[1] - u_full.numel()].any().item() is False  # left padding
        torch.testing.assert_close(padded["log_probs"].full[b][attn_p[b]], unpadded["log_probs"][b].full)
        n = unpadded["tokens"][b].response.numel()
        assert torch.equal(padded["tokens"].response[b, :n], unpadded["tokens"][b].response)  # right padding
        assert torch.equal(lp_resp_p[b, n:], torch.zeros(lp_resp_p.shape[1] - n))
        assert torch.equal(s_full, u_full)  # greedy ids do not depend on the batch
        torch.testing.assert_close(single["log_probs"][0].response, unpadded["log_probs"][b].response,
                                   atol=1e-5, rtol=0)


def test_log_prob_version_padded_matches_unpadded(tiny, tokenizer):
    td = _tokens_td(tokenizer)
    full = td.get(("tokens", "prompt"), as_list=True)
    td = TensorDict(tokens=lazy_stack([Tokens(full=f, padded=False) for f in full]), batch_size=[3])
    a = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)(td.copy())
    b = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True)(td.copy())
    for i, f in enumerate(full):
        ref = _ref_log_probs(tiny, f)
        torch.testing.assert_close(a["log_probs"][i].full, ref, atol=1e-5, rtol=0)
        m = b["masks"].all_attention_mask[i]
        torch.testing.assert_close(b["log_probs"].full[i][m], ref, atol=1e-5, rtol=0)
        assert torch.equal(b["log_probs"].full[i][~m], torch.zeros(int((~m).sum())))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4), seed=st.integers(0, 10_000),
       pad=st.booleans())
def test_property_log_probs_batch_invariant(tiny, tokenizer, lengths, seed, pad):
    """Rows scored in any batch, padded or not, equal the row alone; position 0 and padding are 0."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 2000, (n,), generator=g) for n in lengths]
    rows[0][-1] = tokenizer.pad_token_id  # a real end-of-turn id equal to the pad id must stay a real token
    td = TensorDict(tokens=lazy_stack([Tokens(full=r, padded=False) for r in rows]), batch_size=[len(rows)])
    out = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=pad)(td)
    attn = out.get(("masks", "all_attention_mask"), as_padded_tensor=True, padding_side="left")
    lp = out.get(("log_probs", "full"), as_padded_tensor=True, padding_side="left")
    ids = out.get(("tokens", "full"), as_padded_tensor=True, padding_side="left")
    assert attn.sum(-1).tolist() == lengths
    for b, r in enumerate(rows):
        assert torch.equal(ids[b][attn[b]], r)
        torch.testing.assert_close(lp[b][attn[b]], _ref_log_probs(tiny, r), atol=2e-5, rtol=0)
        assert lp[b][attn[b]][0].item() == 0.0
        assert torch.all(lp[b][~attn[b]] == 0)


# ------------------------------------------------------------------------------------- num_samples / stopping
def test_num_samples_shape_and_prompts(tiny, tokenizer):
    torch.manual_seed(3)
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", num_samples=3,
                              generate_kwargs={"max_new_tokens": 4, "temperature": 1.0})
    td = _tokens_td(tokenizer, PROMPTS[:2])
    out = pol(td)
    assert out.batch_size == torch.Size([2, 3]) and out["truncated"].shape == (2, 3)
    for b in range(2):
        for s in range(3):
            assert torch.equal(out["tokens"][b, s].prompt, td["tokens"][b].prompt)
        responses = {tuple(out["tokens"][b, s].response.tolist()) for s in range(3)}
        assert len(responses) == 3  # independent samples (49k-token vocabulary)
    scored = pol.get_new_version(generate=False)(out.copy())
    assert scored.batch_size == torch.Size([2, 3])
    torch.testing.assert_close(scored["log_probs"][1, 2].response, out["log_probs"][1, 2].response, atol=1e-4,
                               rtol=0)
    assert "tokens" not in td.keys() or td["tokens"][0].response is None  # inplace=False left the input alone


def test_two_eos_ids_and_truncation(tokenizer):
    model = tiny_model(tokenizer, seed=2)
    td = _tokens_td(tokenizer)
    free = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
                               generate_kwargs={"max_new_tokens": 6})(td.copy())
    seqs = [free["tokens"][b].response.tolist() for b in range(3)]
    a, b_ = seqs[0][1], seqs[1][3]
    model.generation_config.eos_token_id = [a, b_]
    out = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
                              generate_kwargs={"max_new_tokens": 6})(td.copy())
    for row, seq in enumerate(seqs):
        stops = [i for i, t in enumerate(seq) if t in (a, b_)]
        expected = seq[: stops[0] + 1] if stops else seq
        assert out["tokens"][row].response.tolist() == expected
        assert out["truncated"][row].item() == (not stops)
    assert out["truncated"][0].item() is False and out["truncated"][1].item() is False
    # truncation: 2 tokens, no stop id among the first two of row 1 -> truncated
    short = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
                                generate_kwargs={"max_new_tokens": 1})(td.copy())
    assert short["truncated"].tolist() == [seqs[r][0] not in (a, b_) for r in range(3)]


def test_truncated_history_is_incomplete(tiny, tokenizer):
    out = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 2})(_history_td(CONVS))
    assert out["truncated"].tolist() == [True, True]
    for b in range(2):
        assert out["history"][b].response.is_complete == [False]
        assert out["history"][b].response.content[0] == tokenizer.decode(out["tokens"][b].response.tolist())
        assert out["tokens"][b].response.numel() == 2


# ------------------------------------------------------------------------------------- text mode, dists, versions
def test_text_mode_and_inplace_variants(tiny, tokenizer):
    td = TensorDict(text=lazy_stack([Text(prompt=p) for p in PROMPTS[:2]]), batch_size=[2])
    out = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text", inplace="empty",
                              generate_kwargs={"max_new_tokens": 3})(td)
    assert out is not td and set(out.keys()) == {"text", "tokens", "masks", "log_probs", "truncated"}
    for b in range(2):
        assert torch.equal(out["tokens"][b].prompt, torch.tensor(tokenizer(PROMPTS[b])["input_ids"]))
        assert out["text"][b].full == PROMPTS[b] + tokenizer.decode(out["tokens"][b].response.tolist())
    assert set(td.keys()) == {"text"}
    kept = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text", inplace=False,
                               generate_kwargs={"max_new_tokens": 3})(td)
    assert set(td.keys()) == {"text"} and "tokens" in kept.keys()
    same = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text",
                               generate_kwargs={"max_new_tokens": 3})(td)
    assert same is td and "tokens" in td.keys()


def test_dists_and_logits_only(tiny, tokenizer):
    torch.manual_seed(0)
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 4, "temperature": 0.7})
    out = pol(_history_td(CONVS))
    lpv = pol.get_new_version(generate=False)
    scored = lpv(out.copy())
    logits_td = lpv(out.copy(), logits_only=True)
    logits = logits_td["logits"]
    attn = logits_td["masks"].all_attention_mask
    assert logits.shape[:2] == attn.shape and logits.dtype == torch.float32
    lp_full = scored.get(("log_probs", "full"), as_padded_tensor=True, padding_side="left")
    ids = logits_td["tokens"].full
    manual = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    first = attn & (attn.long().cumsum(-1) == 1)
    torch.testing.assert_close(manual[attn & ~first], lp_full[attn & ~first], atol=1e-5, rtol=0)
    lengths = attn.sum(-1)
    resp_len = torch.tensor([out["tokens"][b].response.numel() for b in range(2)])
    for name, expected_count in [("get_generic_dist", lengths - 1), ("get_sft_dist", resp_len),
                                 ("get_rlhf_dist", resp_len)]:
        dist = getattr(lpv, name)(out.copy())
        assert torch.equal(dist.mask.sum(-1), expected_count), name
        torch.testing.assert_close(dist.log_prob(dist.tokens), lp_full * dist.mask, atol=1e-5, rtol=0)
    sft = lpv.get_sft_dist(out.copy())
    assert torch.equal(sft.mask[:, -4:].sum(-1), resp_len.clamp(max=4))  # response is right-aligned (left padding)
    assert lpv._get_sft_dist(out.copy()).mask.equal(sft.mask)
    with pytest.raises(NotImplementedError, match=r"get_sft_dist needs the log-prob version"):
        pol.get_sft_dist(out)
    with pytest.raises(ValueError, match=r"logits_only=True needs the log-prob version"):
        pol(out.copy(), logits_only=True)


def test_get_new_version_carries_settings(tiny, tokenizer):
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="text", input_key=("q", "prompt"),
                              generate_kwargs={"max_new_tokens": 3, "temperature": 0.5}, pad_output=True,
                              log_probs_key="lp", batching=True, max_batch_size=4, chunk_size=64)
    assert isinstance(pol, LLMWrapperBase)
    lpv = pol.get_new_version(generate=False)
    assert lpv.model is tiny and lpv.generate is False and lpv.pad_output is True
    assert lpv.input_key == ("q", "full") and lpv.log_probs_key == "lp" and lpv.temperature == 0.5
    assert lpv.chunk_size == 64 and lpv.generate_kwargs == {"max_new_tokens": 3, "temperature": 0.5}
    assert lpv._batching_settings() == pol._batching_settings()
    back = lpv.get_new_version(generate=True)
    assert back.input_key == ("q", "prompt") and back.generation_config == pol.generation_config
    assert pol.get_new_version(input_mode="tokens").input_key == ("tokens", "prompt")
    with pytest.raises(TypeError, match=r"get_new_version keeps the same model"):
        pol.get_new_version(model=tiny)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"input_mode": "chat"}, "input_mode must be one of ('history', 'text', 'tokens'), got 'chat'"),
    ({"num_samples": 2, "inplace": True}, "inplace=True cannot hold num_samples responses"),
    ({"generate": False, "return_log_probs": False}, "return_log_probs=False contradicts generate=False"),
    ({"generate": False, "num_samples": 2}, "num_samples is only meaningful for generate=True"),
    ({"temperature": 0.0, "generate": False}, "temperature (log-prob version) must be > 0, got 0.0"),
    ({"inplace": "yes"}, "inplace must be True, False, 'empty' or None, got 'yes'"),
])
def test_constructor_errors(tiny, tokenizer, kwargs, message):
    with pytest.raises(ValueError) as err:
        TransformersWrapper(tiny, tokenizer=tokenizer, **kwargs)
    assert message in str(err.value)


def test_missing_input_key_error(tiny, tokenizer):
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"the input has no \('history', 'prompt'\) \(prompt History"):
        pol(TensorDict(text=lazy_stack([Text(prompt="x")]), batch_size=[1]))


def test_prompt_longer_than_context_raises(tokenizer):
    model = tiny_model(tokenizer, max_position_embeddings=16)
    pol = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 8})
    td = TensorDict(tokens=lazy_stack([Tokens(prompt=torch.arange(10) + 100)]), batch_size=[1])
    with pytest.raises(ValueError, match=r"prompt row 0 has 10 tokens; with max_new_tokens=8 it exceeds the model's "
                                         r"context of 16 tokens"):
        pol(td)


def test_single_item_input(tiny, tokenizer):
    item = TensorDict(tokens=Tokens(prompt=torch.tensor(tokenizer("Hi")["input_ids"])), batch_size=[])
    out = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens",
                              generate_kwargs={"max_new_tokens": 3})(item)
    assert out.batch_size == torch.Size([]) and out["tokens"].response.numel() == 3
