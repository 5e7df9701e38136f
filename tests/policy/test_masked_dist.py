"""``ChunkedLLMMaskedCategorical`` and the log-prob version's distributions built on it (no ``[B, T, V]`` logits).

Reference numbers are computed independently: full logits (``hidden @ W.T + b`` or ``model(ids).logits`` of one
unpadded row at a time), ``log_softmax``, ``gather``, ``argmax``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import ChatHistory, Tokens
from lit_llm.data.history import History
from lit_llm.distributions import LLMMaskedCategorical
from lit_llm.policy import (
    ChunkedLLMMaskedCategorical,
    TransformersWrapper,
    chunked_token_log_probs,
    completion_hidden_states,
    completion_log_probs,
    model_token_log_probs,
    token_hidden_states,
)
from lit_llm.policy.logprobs import IGNORE_INDEX


def close(actual, expected, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def close_grad(actual, expected, rtol=1e-5):
    """Relative ``rtol`` at the tensor's scale (fp32 sums in another order cancel differently near 0)."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()) + 1e-9)


# --------------------------------------------------------------------------------------- the class on its own
def random_head(b=3, t=9, h=8, v=23, seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) * 2).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_() if with_bias else None
    mask = torch.rand(b, t, generator=g) < 0.7
    value = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, bias, mask, value


def reference(hidden, weight, bias, mask, value, temperature):
    """The base class on materialised logits, plus the naive argmax hits."""
    logits = (hidden @ weight.t() + (0 if bias is None else bias)) / temperature
    base = LLMMaskedCategorical(logits, mask)
    hits = (logits.argmax(-1) == value) & mask
    return base.log_prob(value), base.entropy(), hits, logits


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_full_logits_values_hits_and_gradients(chunk_size, temperature, with_bias):
    hidden, weight, bias, mask, value = random_head(with_bias=with_bias)
    params = [p for p in (hidden, weight, bias) if p is not None]
    ref_lp, ref_ent, _, logits = reference(hidden, weight, bias, mask, value, temperature)
    value = torch.where(torch.rand(value.shape, generator=torch.Generator().manual_seed(5)) < 0.5,
                        logits.argmax(-1), value)  # half the positions are hits
    ref_lp, ref_ent, ref_hits, _ = reference(hidden, weight, bias, mask, value, temperature)
    ref_grads = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), params)

    dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, bias=bias, temperature=temperature,
                                       chunk_size=chunk_size)
    lp, ent, hits = dist.log_prob_and_entropy(value, return_hits=True)
    assert lp.dtype == ent.dtype == torch.float32 and hits.dtype == torch.bool and lp.shape == mask.shape
    close(lp, ref_lp)
    close(ent, ref_ent)
    assert torch.equal(hits, ref_hits) and 0 < int(hits.sum()) < int(mask.sum())
    assert torch.equal(lp[~mask], torch.zeros(int((~mask).sum()))) and torch.equal(ent[~mask], lp[~mask])
    for got, want in zip(torch.autograd.grad(lp.sum() + ent.sum(), params), ref_grads):
        close_grad(got, want)
    # the single-purpose methods give the same numbers
    close(dist.log_prob(value), lp, rtol=0, atol=1e-6)
    close(dist.entropy(), ent, rtol=0, atol=1e-6)
    lp2, ent2 = dist.log_prob_and_entropy(value)
    assert torch.equal(lp2, lp) and torch.equal(ent2, ent)


def test_masked_positions_are_zero_and_get_no_gradient():
    hidden, weight, bias, mask, value = random_head(seed=1)
    value = value.masked_fill(~mask, IGNORE_INDEX)  # any id is allowed where the mask is False
    dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, bias=bias, chunk_size=4)
    lp, ent = dist.log_prob_and_entropy(value)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(hidden.grad[~mask], torch.zeros(int((~mask).sum()), hidden.shape[-1]))
    assert hidden.grad[mask].abs().sum(-1).gt(0).all()


def test_hand_values_three_tokens():
    hidden = torch.ones(1, 2, 1)
    weight = torch.log(torch.tensor([[1.0], [2.0], [3.0]]))  # logits ln1, ln2, ln3 -> p = 1/6, 2/6, 3/6
    dist = ChunkedLLMMaskedCategorical(hidden, weight, torch.tensor([[True, False]]))
    lp, ent, hits = dist.log_prob_and_entropy(torch.tensor([[2, -100]]), return_hits=True)
    close(lp, torch.tensor([[torch.log(torch.tensor(0.5)).item(), 0.0]]), rtol=0, atol=1e-6)
    assert ent[0, 0].item() == pytest.approx(1.0114043, abs=1e-6) and ent[0, 1].item() == 0.0
    assert hits.tolist() == [[True, False]]
    assert dist.mode.tolist() == [[2, -100]]


def test_full_logit_views_and_samples():
    hidden, weight, bias, mask, value = random_head(seed=2)
    dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, bias=bias, temperature=0.5)
    logits = dist.logits
    assert logits.shape == (3, 9, 23) and logits.dtype == torch.float32 and logits.requires_grad
    close(logits, (hidden @ weight.t() + bias) / 0.5, rtol=1e-6, atol=1e-6)
    assert dist.logits is not logits  # recomputed on demand, never cached
    close(dist.probs.sum(-1), torch.ones(3, 9))
    assert torch.equal(dist.mode, logits.argmax(-1).masked_fill(~mask, IGNORE_INDEX))
    assert dist.masked_logits[~mask].eq(torch.finfo(torch.float32).min).all()
    torch.manual_seed(0)
    s = dist.sample((4,))
    assert s.shape == (4, 3, 9) and s.dtype == torch.long and (s[:, ~mask] == IGNORE_INDEX).all()
    assert ((s[:, mask] >= 0) & (s[:, mask] < 23)).all()
    assert dist.batch_shape == (3, 9) and dist.num_classes == 23 and dist.tokens is None
    # sample dims broadcast in log_prob, as in the base class
    close(dist.log_prob(s), LLMMaskedCategorical(logits, mask).log_prob(s))
    assert "ChunkedLLMMaskedCategorical(hidden: (3, 9, 8)" in repr(dist)


def test_chunked_kernel_return_hits_orders():
    hidden, weight, bias, mask, value = random_head(seed=3)
    targets = value.masked_fill(~mask, IGNORE_INDEX)
    logits = hidden @ weight.t() + bias
    targets = torch.where(mask & (torch.arange(9) % 2 == 0), logits.argmax(-1), targets)
    want = (logits.argmax(-1) == targets) & mask
    lp, hits = chunked_token_log_probs(hidden, weight, targets, bias=bias, chunk_size=4, return_hits=True)
    assert hits.dtype == torch.bool and torch.equal(hits, want) and not hits.requires_grad
    lp3, ent, hits3 = chunked_token_log_probs(hidden, weight, targets, bias=bias, chunk_size=4, return_hits=True,
                                              return_entropy=True)
    assert torch.equal(lp3, lp) and torch.equal(hits3, want) and ent.shape == lp.shape
    assert torch.equal(chunked_token_log_probs(hidden, weight, targets, bias=bias, chunk_size=4), lp)


@pytest.mark.parametrize(("make", "match"), [
    (lambda h, w, m: dict(hidden=h[0, 0], weight=w, mask=m[0, 0]),
     r"hidden must be a floating-point tensor \[\.\.\., T, H\]"),
    (lambda h, w, m: dict(hidden=h.long(), weight=w, mask=m), "hidden must be a floating-point"),
    (lambda h, w, m: dict(hidden=h, weight=w[:, :3], mask=m),
     r"weight must be the \[V, H\] .* H = hidden.shape\[-1\] = 8"),
    (lambda h, w, m: dict(hidden=h, weight=w, mask=m, bias=torch.zeros(5)), r"bias must be None or a float \[V\]"),
    (lambda h, w, m: dict(hidden=h, weight=w, mask=m[:, :3]), r"mask shape \(3, 3\) must equal hidden.shape\[:-1\]"),
    (lambda h, w, m: dict(hidden=h, weight=w, mask=m.float()), "mask must be a bool"),
    (lambda h, w, m: dict(hidden=h, weight=w, mask=m, temperature=0.0), "temperature must be a number > 0"),
    (lambda h, w, m: dict(hidden=h, weight=w, mask=m, chunk_size=0), "chunk_size must be an int >= 1"),
    (lambda h, w, m: dict(hidden=h, weight=w, mask=m, matmul_dtype=torch.int32), "matmul_dtype must be None or"),
])
def test_constructor_errors(make, match):
    hidden, weight, _, mask, _ = random_head()
    kwargs = make(hidden.detach(), weight.detach(), mask)
    with pytest.raises(ValueError, match=match):
        ChunkedLLMMaskedCategorical(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("mask"), **kwargs)


def test_value_errors():
    hidden, weight, bias, mask, value = random_head()
    dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, bias=bias)
    with pytest.raises(ValueError, match=r"log_prob: value must be an integer tensor of token ids"):
        dist.log_prob(value.float())
    with pytest.raises(ValueError, match=r"log_prob_and_entropy: value shape \(3, 4\) does not broadcast"):
        dist.log_prob_and_entropy(value[:, :4])
    bad = value.clone()
    pos = tuple(int(i) for i in mask.nonzero()[0])
    bad[pos] = -100
    with pytest.raises(ValueError, match=rf"value at masked-in position \({pos[0]}, {pos[1]}\) is -100, outside the "
                                         rf"vocabulary \[0, 23\)"):
        dist.log_prob(bad)


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 7), chunk=st.integers(1, 9), seed=st.integers(0, 10_000),
       density=st.floats(0.0, 1.0))
def test_property_equals_base_class_on_any_mask(b, t, chunk, seed, density):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(b, t, 5, generator=g), torch.randn(11, 5, generator=g)
    mask = torch.rand(b, t, generator=g) < density
    value = torch.randint(0, 11, (b, t), generator=g)
    base = LLMMaskedCategorical(hidden @ weight.t(), mask)
    dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, chunk_size=chunk)
    lp, ent, hits = dist.log_prob_and_entropy(value, return_hits=True)
    close(lp, base.log_prob(value))
    close(ent, base.entropy())
    assert torch.equal(hits, (base.logits.argmax(-1) == value) & mask)


# --------------------------------------------------------------------------------------- on the tiny model
ROWS = [[1, 503, 2050, 17, 9, 1200, 33], [44, 45, 46], [7000, 13, 2, 2]]  # 2 = <|im_end|> = pad id


def pad(rows, side, pad_id=2):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl], attn[i, sl] = torch.tensor(r), True
    return ids, attn


def naive_rows(model, rows, temperature=1.0):
    """Per unpadded row: (log-probs [n-1], entropies [n-1], argmax [n-1]) of x_1.. from model(ids).logits."""
    out = []
    for r in rows:
        logits = model(torch.tensor(r)[None]).logits[0, :-1].float() / temperature
        logp = torch.log_softmax(logits, -1)
        out.append((logp.gather(-1, torch.tensor(r[1:])[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1),
                    logits.argmax(-1)))
    return out


def dense_td(ids, attn, asst=None):
    data = {("tokens", "full"): ids, ("masks", "all_attention_mask"): attn}
    if asst is not None:
        data["masks", "all_assistant_mask"] = asst
    return TensorDict(data, batch_size=[ids.shape[0]])


def lpv(model, tokenizer, **kwargs):
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False, **kwargs)


@pytest.mark.parametrize("side", ["left", "right"])
def test_dense_dist_equals_full_logits_values_hits_and_gradients(tiny, tokenizer, side):
    ids, attn = pad(ROWS, side)
    params = [tiny.get_output_embeddings().weight, tiny.model.layers[-1].mlp.down_proj.weight,
              tiny.model.layers[0].self_attn.q_proj.weight]
    with torch.no_grad():
        ref = naive_rows(tiny, ROWS, temperature=0.7)
    # make some positions hits: replace x_t by the naive argmax (the reference is recomputed for those ids)
    rows = [[r[0]] + [int(a) if k % 2 else x for k, (x, a) in enumerate(zip(r[1:], am))]
            for r, (_, _, am) in zip(ROWS, ref)]
    ids, attn = pad(rows, side)
    ref = naive_rows(tiny, rows, temperature=0.7)
    want_grads = torch.autograd.grad(sum(lp.sum() + ent.sum() for lp, ent, _ in ref), params)

    policy = lpv(tiny, tokenizer, temperature=0.7, chunk_size=3)
    td = dense_td(ids, attn)
    dist = policy.get_dist(td)
    assert isinstance(dist, ChunkedLLMMaskedCategorical) and dist.tokens is td["tokens", "full"]
    assert dist.temperature == 0.7 and dist.chunk_size == 3
    lp, ent, hits = dist.log_prob_and_entropy(dist.tokens, return_hits=True)
    for i, (r, (r_lp, r_ent, r_arg)) in enumerate(zip(rows, ref)):
        real = attn[i].nonzero().squeeze(1)
        close(lp[i, real[1:]], r_lp.detach())
        close(ent[i, real[1:]], r_ent.detach())
        assert torch.equal(hits[i, real[1:]], r_arg == torch.tensor(r[1:]))
        assert lp[i, real[0]] == 0 and ent[i, real[0]] == 0 and not hits[i, real[0]]
    assert (lp[~attn] == 0).all() and (ent[~attn] == 0).all() and not hits[~attn].any() and hits.any()
    for got, want in zip(torch.autograd.grad(lp.sum() + ent.sum(), params), want_grads):
        close_grad(got, want)


@pytest.mark.parametrize("side", ["left", "right"])
def test_dist_equals_model_token_log_probs_values_and_gradients(tiny, tokenizer, side):
    """What training replaces: ``model_token_log_probs(..., return_entropy=True)``, at 1e-6 in fp32."""
    ids, attn = pad(ROWS, side)
    params = list(tiny.parameters())
    lp_ref, ent_ref = model_token_log_probs(tiny, ids, attn, temperature=0.7, chunk_size=4, return_entropy=True)
    grads_ref = torch.autograd.grad((lp_ref * 1.5).sum() + ent_ref.sum(), params)
    dist = lpv(tiny, tokenizer, temperature=0.7, chunk_size=4).get_dist(dense_td(ids, attn))
    lp, ent = dist.log_prob_and_entropy(dist.tokens)
    close(lp, lp_ref.detach(), rtol=0, atol=1e-6)
    close(ent, ent_ref.detach(), rtol=0, atol=1e-6)
    for got, want in zip(torch.autograd.grad((lp * 1.5).sum() + ent.sum(), params), grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()) + 1e-12)


def test_token_hidden_states_alignment(tiny):
    ids, attn = pad(ROWS, "right")
    hidden = token_hidden_states(tiny, ids, attn)
    assert hidden.shape == (3, 7, 64)
    out = tiny.model(input_ids=torch.tensor(ROWS[1])[None]).last_hidden_state[0]
    close(hidden[1, 1:3], out[:2])  # hidden[:, t] = backbone output at t - 1
    assert (hidden[1, 0] == 0).all() and (hidden[1, 3:] == 0).all()
    lefty, lattn = pad(ROWS, "left")
    left = token_hidden_states(tiny, lefty, lattn)
    close(left[1, -2:], out[:2])
    assert (left[1, :-2] == 0).all()  # padding and the row's first real token have no prediction


def test_dense_path_equals_ragged_path(tiny, tokenizer):
    policy = lpv(tiny, tokenizer, chunk_size=5)
    ragged = TensorDict(tokens=lazy_stack([Tokens(full=torch.tensor(r), padded=False) for r in ROWS]),
                        batch_size=[3])
    r_dist = policy.get_dist(ragged)
    ids, attn = pad(ROWS, "right")
    d_dist = policy.get_dist(dense_td(ids, attn))
    with torch.no_grad():
        r_lp, r_ent = r_dist.log_prob_and_entropy(r_dist.tokens)
        d_lp, d_ent = d_dist.log_prob_and_entropy(d_dist.tokens)
    assert r_dist.tokens.shape == d_dist.tokens.shape == (3, 7)
    for i, r in enumerate(ROWS):  # ragged rows are left-padded, the dense input is right-padded as given
        n = len(r)
        assert torch.equal(r_dist.tokens[i, -n:], d_dist.tokens[i, :n])
        assert torch.equal(r_dist.mask[i, -n:], d_dist.mask[i, :n])
        close(r_lp[i, -n:], d_lp[i, :n], rtol=0, atol=1e-6)
        close(r_ent[i, -n:], d_ent[i, :n], rtol=0, atol=1e-6)
    # the ragged dist's logits are forward(logits_only=True)'s
    close(r_dist.logits, policy(ragged.copy(), logits_only=True)["logits"])


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), side=st.sampled_from(["left", "right"]),
       int_mask=st.booleans(), seed=st.integers(0, 1000))
def test_property_dense_dist_is_padding_invariant(tiny, tokenizer, lengths, side, int_mask, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    ids, attn = pad(rows, side)
    dist = lpv(tiny, tokenizer, chunk_size=3).get_dist(dense_td(ids, attn.long() if int_mask else attn))
    with torch.no_grad():
        lp = dist.log_prob(dist.tokens)
        for i, r in enumerate(rows):
            single = model_token_log_probs(tiny, torch.tensor([r]), torch.ones(1, len(r)), chunk_size=3)[0]
            close(lp[i][attn[i]], single, rtol=0, atol=1e-5)
    assert torch.equal(dist.mask, attn & (attn.long().cumsum(-1) > 1))
    assert (lp[~dist.mask] == 0).all()


# --------------------------------------------------------------------------------------- head masks
# A hand-built dense batch (ids are arbitrary in-vocabulary tokens). Row 0: left-padded, two assistant turns and a
# trailing separator; row 1: right-padded, one assistant run then two attended non-assistant tokens; row 2: no
# assistant token; row 3: the assistant run starts at the row's first token.
ATTN = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
                     [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                     [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                     [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
ASST = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 1, 0],
                     [0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
GENERIC = ATTN & (ATTN.long().cumsum(-1) > 1)
RLHF = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 1, 1, 0],
                     [0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                     [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
SFT_LAST_RUN = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
                             [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                             [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)


def hand_batch():
    ids = torch.arange(100, 140).reshape(4, 10)
    ids[~ATTN] = 2
    return ids


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long])
def test_head_masks_exact_on_a_hand_built_batch(tiny, tokenizer, mask_dtype):
    policy = lpv(tiny, tokenizer)
    td = dense_td(hand_batch(), ATTN.to(mask_dtype), ASST.to(mask_dtype))
    for head, want in [("generic", GENERIC), ("rlhf", RLHF), ("sft", SFT_LAST_RUN)]:
        mask = policy.head_mask(td, head)
        assert mask.dtype == torch.bool and torch.equal(mask, want), head
        dist = getattr(policy, f"get_{head}_dist")(td)
        assert torch.equal(dist.mask, want) and dist.tokens is td["tokens", "full"], head
    assert torch.equal(policy.get_dist(td).mask, GENERIC)
    assert torch.equal(policy.get_dist(td, mask_key=("masks", "all_assistant_mask")).mask, RLHF)
    assert torch.equal(policy.get_dist(td, mask=ASST).mask, RLHF)  # explicit masks lose unpredicted positions too


def test_sft_mask_from_tokens_prompt_ends_at_the_last_assistant_token(tiny, tokenizer):
    policy = lpv(tiny, tokenizer)
    ids = hand_batch()
    prompt_lens = [5, 2, 4, 1]  # real prompt tokens of each row
    rows = []
    for b in range(4):
        real = ids[b][ATTN[b]]
        rows.append(TensorDict({("tokens", "full"): ids[b], ("tokens", "prompt"): real[:prompt_lens[b]],
                                ("masks", "all_attention_mask"): ATTN[b], ("masks", "all_assistant_mask"): ASST[b]}))
    td = lazy_stack(rows)
    want = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 0],  # after the 5-token prompt, up to the last assistant token
                         [0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
                         [0, 0, 0, 0, 1, 1, 1, 1, 1, 1],  # no assistant token: the whole rest of the row
                         [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(policy.head_mask(td, "sft"), want)
    assert torch.equal(policy.get_sft_dist(td).mask, want)
    no_asst = td.exclude(("masks", "all_assistant_mask"))
    assert torch.equal(policy.head_mask(no_asst, "sft")[0], torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1]).bool())
    bad = lazy_stack([r.clone() for r in rows])
    bad[0]["tokens", "prompt"] = torch.tensor([100, 999])
    with pytest.raises(ValueError, match="not a prefix|differ"):
        policy.head_mask(bad, "sft")


def test_last_assistant_run_equals_the_history_render_on_chatml(tiny, tokenizer):
    """Dense ids + assistant mask only (the last-run rule) == history mode (prompt from the render)."""
    convs = [[{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
             [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Colour?"},
              {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "Another"},
              {"role": "assistant", "content": "Red"}]]
    hist = History.from_chats(convs)
    enc = hist.apply_chat_template(tokenizer, padding=True, padding_side="left", return_assistant_tokens_mask=True,
                                   add_generation_prompt=False)
    td = dense_td(enc["input_ids"], enc["attention_mask"], enc["assistant_masks"])
    dense_sft = lpv(tiny, tokenizer).head_mask(td, "sft")
    history = TransformersWrapper(tiny, tokenizer=tokenizer, generate=False)
    htd = TensorDict(history=ChatHistory(full=hist, batch_size=[2]), batch_size=[2])
    assert torch.equal(history.head_mask(htd, "sft"), dense_sft)
    assert [tokenizer.decode(enc["input_ids"][b][dense_sft[b]]) for b in range(2)] == ["4<|im_end|>",
                                                                                     "Red<|im_end|>"]
    assert torch.equal(history.head_mask(htd, "rlhf"), lpv(tiny, tokenizer).head_mask(td, "rlhf"))


def test_head_mask_runs_no_forward_pass(tiny, tokenizer):
    policy = lpv(tiny, tokenizer)
    td = dense_td(hand_batch(), ATTN, ASST)

    def boom(*args, **kwargs):
        raise AssertionError("head_mask ran the model")

    handle = tiny.model.register_forward_pre_hook(boom)
    try:
        for head in ("generic", "rlhf", "sft"):
            policy.head_mask(td, head)
    finally:
        handle.remove()


def test_head_mask_and_dist_errors(tiny, tokenizer):
    policy = lpv(tiny, tokenizer)
    td = dense_td(hand_batch(), ATTN)
    with pytest.raises(ValueError, match=r"^head_mask\('sft'\): the prompt is unknown: pass \('tokens', 'prompt'\)"):
        policy.head_mask(td, "sft")
    with pytest.raises(ValueError, match=r"^get_sft_dist: the prompt is unknown"):
        policy.get_sft_dist(td)
    with pytest.raises(ValueError, match=r"^get_rlhf_dist: no assistant mask at \('masks', 'all_assistant_mask'\)"):
        policy.get_rlhf_dist(td)
    with pytest.raises(ValueError, match=r"head_mask: unknown head 'dpo'"):
        policy.head_mask(td, "dpo")
    with pytest.raises(ValueError, match=r"^get_dist: mask must be a bool .* of shape \[4, 10\]"):
        policy.get_dist(td, mask=ATTN[:, 1:])
    with pytest.raises(ValueError, match=r"^get_dist: mask_key 'nope' is not a dense mask of the input"):
        policy.get_dist(td, mask_key="nope")
    with pytest.raises(ValueError, match=r"all_attention_mask'\) must be a bool \(or 0/1 integer\)"):
        policy.get_dist(dense_td(hand_batch(), ATTN.float()))
    with pytest.raises(ValueError, match=r"row 0 holds id 50000 at position 1, outside the model's vocabulary"):
        policy.get_dist(dense_td(torch.tensor([[5, 50000]]), torch.ones(1, 2, dtype=torch.bool)))
    gen = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens")
    for call in (lambda: gen.get_dist(td), lambda: gen.head_mask(td, "generic")):
        with pytest.raises(NotImplementedError, match="needs the log-prob version"):
            call()


def test_single_item_input_gives_a_dist_over_positions(tiny, tokenizer):
    policy = lpv(tiny, tokenizer)
    ids, attn = pad(ROWS, "left")
    td = dense_td(ids, attn)
    one = policy.get_dist(td[1])
    assert one.batch_shape == (7,) and torch.equal(one.tokens, ids[1])
    with torch.no_grad():
        close(one.log_prob(one.tokens), policy.get_dist(td).log_prob(ids)[1], rtol=0, atol=1e-6)
    assert policy.head_mask(td[1], "generic").shape == (7,)


def test_grad_mode_is_the_callers_also_under_batching(tiny, tokenizer):
    ids, attn = pad(ROWS, "left")
    for batching in (False, True):
        policy = lpv(tiny, tokenizer, batching=batching)
        try:
            dist = policy.get_dist(dense_td(ids, attn))
            assert dist.hidden.requires_grad
            dist.log_prob(dist.tokens).sum().backward()
            assert tiny.model.layers[0].mlp.up_proj.weight.grad is not None
            tiny.zero_grad(set_to_none=True)
            with torch.no_grad():
                assert not policy.get_dist(dense_td(ids, attn)).hidden.requires_grad
        finally:
            policy.cleanup_batching()


# --------------------------------------------------------------------------------------- GRPO prompt/completion layout
def grpo_td(loss_mask=None):
    prompts, completions, index = [[5, 6, 7], [8]], [[9, 10, 11], [12], [13, 14]], [0, 1, 0]
    p_ids, p_mask = pad(prompts, "left", pad_id=0)
    c_ids, c_mask = pad(completions, "right", pad_id=0)
    data = dict(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask,
                prompt_index=torch.tensor(index))
    if loss_mask is not None:
        data["loss_mask"] = loss_mask
    return TensorDict(data, batch_size=[])


@pytest.mark.parametrize("share_prompts", [True, False])
def test_grpo_layout_equals_completion_log_probs(tiny, tokenizer, share_prompts):
    td = grpo_td()
    args = [td[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "prompt_index")]
    params = list(tiny.parameters())
    lp_ref, ent_ref = completion_log_probs(tiny, *args, share_prompts=share_prompts, temperature=0.7, chunk_size=2,
                                           return_entropy=True)
    grads_ref = torch.autograd.grad(lp_ref.sum() + ent_ref.sum(), params, allow_unused=True)
    policy = lpv(tiny, tokenizer, temperature=0.7, chunk_size=2, share_prompts=share_prompts)
    assert policy.get_new_version(chunk_size=3).share_prompts is share_prompts
    dist = policy.get_dist(td)
    assert dist.tokens is td["completion_ids"] and torch.equal(dist.mask, td["completion_mask"])
    lp, ent = dist.log_prob_and_entropy(dist.tokens)
    close(lp, lp_ref.detach(), rtol=0, atol=1e-6)
    close(ent, ent_ref.detach(), rtol=0, atol=1e-6)
    for got, want in zip(torch.autograd.grad(lp.sum() + ent.sum(), params, allow_unused=True), grads_ref):
        if want is None:
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()) + 1e-12)


def test_grpo_layout_hidden_states_both_modes_agree(tiny):
    td = grpo_td()
    args = [td[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "prompt_index")]
    shared = completion_hidden_states(tiny, *args)
    full = completion_hidden_states(tiny, *args, share_prompts=False)
    assert shared.shape == (3, 3, 64)
    close(shared, full)
    assert (shared[~td["completion_mask"]] == 0).all()


def test_grpo_layout_loss_mask_and_errors(tiny, tokenizer):
    loss = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)  # [1, 2] and [2, 2] are padding
    policy = lpv(tiny, tokenizer)
    td = grpo_td(loss)
    want = loss & td["completion_mask"]
    for head in ("sft", "rlhf", "generic"):
        assert torch.equal(policy.head_mask(td, head), want)
    dist = policy.get_dist(td)
    assert torch.equal(dist.mask, want)
    with torch.no_grad():
        assert (dist.log_prob(dist.tokens)[~want] == 0).all()
    assert torch.equal(policy.get_dist(td, mask_key="completion_mask").mask, td["completion_mask"])
    with pytest.raises(ValueError, match=r"needs the keys .* missing \['prompt_index'\]"):
        policy.get_dist(td.exclude("prompt_index"))
    with pytest.raises(ValueError, match=r"loss_mask must be a bool .* of shape \[3, 3\]"):
        policy.get_dist(grpo_td(loss[:, :2]))
    bad = grpo_td()
    bad["prompt_index"] = torch.tensor([0, 2, 0])
    with pytest.raises(ValueError, match=r"completion_hidden_states: prompt_index must lie in \[0, 2\)"):
        policy.get_dist(bad)
