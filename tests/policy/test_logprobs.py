"""Tests of the chunked token log-prob kernel and ``model_token_log_probs`` (issue 3, DESIGN.md property 4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lit_llm.policy.logprobs import (
    IGNORE_INDEX,
    chunked_token_log_probs,
    completion_log_probs,
    model_token_log_probs,
    naive_token_log_probs,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def close(actual, expected, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def close_grad(actual, expected, rtol=1e-5):
    """Relative 1e-5 at the tensor's scale: fp32 sums over many rows cancel, so near-zero entries get atol too."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def naive_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1).masked_fill(targets == IGNORE_INDEX, 0.0)


# --- hand-computed values on a 3-token vocabulary -------------------------------------------------------------------
# hidden = [1], W = [[0], [ln2], [ln3]]  ->  logits [0, ln2, ln3]  ->  p = [1/6, 2/6, 3/6]


def three_token_head():
    hidden = torch.ones(1, 1, 1, requires_grad=True)  # [B=1, T=1, H=1]
    weight = torch.tensor([[0.0], [LN2], [LN3]], requires_grad=True)  # [V=3, H=1]
    return hidden, weight


@pytest.mark.parametrize("target, expected", [(0, math.log(1 / 6)), (1, math.log(2 / 6)), (2, math.log(3 / 6))])
def test_hand_values_three_tokens(target, expected):
    hidden, weight = three_token_head()
    lp = chunked_token_log_probs(hidden, weight, torch.tensor([[target]]))
    assert lp.dtype == torch.float32 and lp.shape == (1, 1)
    assert lp.item() == pytest.approx(expected, abs=1e-6)


def test_hand_entropy_and_gradients_three_tokens():
    hidden, weight = three_token_head()
    lp, ent = chunked_token_log_probs(hidden, weight, torch.tensor([[2]]), return_entropy=True)
    # H = 1/6 ln6 + 1/3 ln3 + 1/2 ln2 = 0.298627 + 0.366204 + 0.346574
    assert ent.item() == pytest.approx(1.0114043, abs=1e-6)
    lp.sum().backward()
    # d log p_2 / dh = W_2 - E_p[W] = ln3 - (ln2/3 + ln3/2) = ln3/2 - ln2/3
    assert hidden.grad.item() == pytest.approx(0.3182571, abs=1e-6)
    # d log p_2 / dW_v = (onehot_2 - p)_v * h = [-1/6, -2/6, 1/2]
    close(weight.grad, torch.tensor([[-1 / 6], [-2 / 6], [1 / 2]]))


def test_hand_temperature_and_bias_three_tokens():
    hidden, weight = three_token_head()
    # temperature 2: logits [0, ln2/2, ln3/2] -> unnormalised probs [1, sqrt2, sqrt3]
    lp = chunked_token_log_probs(hidden, weight, torch.tensor([[2]]), temperature=2.0)
    assert lp.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(2) + math.sqrt(3))), abs=1e-6)
    # a bias of [ln3, 0, -ln3] turns the logits into [ln3, ln2, 0] -> p = [3/6, 2/6, 1/6]
    bias = torch.tensor([LN3, 0.0, -LN3])
    lp = chunked_token_log_probs(hidden, weight, torch.tensor([[0]]), bias=bias)
    assert lp.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_ignore_index_gives_zero_and_no_gradient():
    hidden, weight = three_token_head()
    hidden = torch.ones(1, 2, 1, requires_grad=True)
    lp, ent = chunked_token_log_probs(hidden, weight, torch.tensor([[IGNORE_INDEX, 1]]), return_entropy=True)
    assert lp[0, 0].item() == 0.0 and ent[0, 0].item() == 0.0
    assert lp[0, 1].item() == pytest.approx(math.log(2 / 6), abs=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad[0, 0].item() == 0.0


def test_all_ignored_returns_zeros():
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(5, 4)
    lp = chunked_token_log_probs(hidden, weight, torch.full((2, 3), IGNORE_INDEX))
    assert torch.equal(lp, torch.zeros(2, 3))
    lp.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros(2, 3, 4))


# --- chunked == naive (values and gradients) ------------------------------------------------------------------------


def random_problem(b=3, t=11, h=16, v=37, seed=0, ignore_frac=0.2, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(b, t, h, generator=g) * 2).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[torch.rand(b, t, generator=g) < ignore_frac] = IGNORE_INDEX
    return hidden, weight, bias, targets


def naive(hidden, weight, bias, targets, temperature):
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    return naive_token_log_probs(logits, targets, temperature=temperature), naive_entropy(logits, targets, temperature)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 33, 10_000])  # 7 and 4 do not divide 33 = 3 * 11
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_matches_naive_values_and_grads(chunk_size, temperature, with_entropy):
    hidden, weight, bias, targets = random_problem()
    g_lp = torch.randn(targets.shape, generator=torch.Generator().manual_seed(1))
    g_ent = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2))
    params = (hidden, weight, bias)

    ref_lp, ref_ent = naive(hidden, weight, bias, targets, temperature)
    ref_loss = (ref_lp * g_lp).sum() + ((ref_ent * g_ent).sum() if with_entropy else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, params)

    out = chunked_token_log_probs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size,
                                  return_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    close(lp, ref_lp)
    assert torch.equal(lp[targets == IGNORE_INDEX], torch.zeros(int((targets == IGNORE_INDEX).sum())))
    if with_entropy:
        close(ent, ref_ent)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    for name, got, want in zip(("hidden", "weight", "bias"), torch.autograd.grad(loss, params), ref_grads):
        assert got.dtype == want.dtype, name
        close_grad(got, want)


def test_entropy_returned_but_unused_in_loss():
    hidden, weight, bias, targets = random_problem(seed=3)
    lp, _ent = chunked_token_log_probs(hidden, weight, targets, bias=bias, chunk_size=5, return_entropy=True)
    ref_lp, _ = naive(hidden, weight, bias, targets, 1.0)
    got = torch.autograd.grad(lp.sum(), (hidden, weight))
    want = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
    for a, b in zip(got, want):
        close_grad(a, b)


def test_frozen_weight_only_hidden_grad():
    hidden, weight, _, targets = random_problem(with_bias=False, seed=4)
    weight = weight.detach()
    lp = chunked_token_log_probs(hidden, weight, targets, chunk_size=6)
    lp.sum().backward()
    ref = torch.autograd.grad(naive_token_log_probs(hidden @ weight.t(), targets).sum(), hidden)[0]
    close_grad(hidden.grad, ref)
    assert weight.grad is None


def test_no_grad_mode():
    hidden, weight, bias, targets = random_problem(seed=5)
    with torch.no_grad():
        lp = chunked_token_log_probs(hidden, weight, targets, bias=bias, chunk_size=8)
    assert not lp.requires_grad
    close(lp, naive(hidden, weight, bias, targets, 1.0)[0])


def test_bf16_hidden_under_autocast_is_fp32():
    hidden, weight, _, targets = random_problem(with_bias=False, seed=6)
    h16 = hidden.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = chunked_token_log_probs(h16, weight, targets, chunk_size=5)
    assert lp.dtype == torch.float32
    # the kernel upcasts the bf16 hidden states and does the matmul in fp32: equal to naive on h16.float()
    close(lp, naive_token_log_probs(h16.detach().float() @ weight.detach().t(), targets))
    lp.sum().backward()
    assert h16.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    ref_w = torch.autograd.grad(naive_token_log_probs(h16.detach().float() @ weight.t(), targets).sum(), weight)[0]
    close_grad(weight.grad, ref_w)


def test_bf16_matmul_dtype_is_close():
    hidden, weight, bias, targets = random_problem(seed=7)
    lp = chunked_token_log_probs(hidden, weight, targets, bias=bias, matmul_dtype=torch.bfloat16, chunk_size=4)
    assert lp.dtype == torch.float32
    close(lp, naive(hidden, weight, bias, targets, 1.0)[0], rtol=0.0, atol=0.3)  # bf16 logits: |z| ~ 10 -> 1e-1
    lp.sum().backward()
    assert hidden.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=0.0), "temperature must be a number > 0"),
        (dict(temperature=-1.0), "temperature must be a number > 0"),
        (dict(chunk_size=0), "chunk_size must be an int >= 1"),
        (dict(chunk_size=2.5), "chunk_size must be an int >= 1"),
        (dict(bias=torch.zeros(4)), r"bias must be \[V\]=\(5,\)"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chunked_token_log_probs(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long), **kwargs)


def test_bad_shapes_and_targets():
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\]"):
        chunked_token_log_probs(h, torch.randn(5, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must have hidden's leading shape"):
        chunked_token_log_probs(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be integer ids"):
        chunked_token_log_probs(h, w, torch.zeros(2, 3))
    bad = torch.tensor([[0, 1, 2], [3, 5, -1]])
    with pytest.raises(ValueError, match=r"position 4 holds 5, outside the vocabulary \[0, 5\)"):
        chunked_token_log_probs(h, w, bad)


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4), t=st.integers(1, 9), h=st.integers(1, 8), v=st.integers(2, 20),
    chunk=st.integers(1, 40), seed=st.integers(0, 2**16), ignore_frac=st.sampled_from([0.0, 0.3, 1.0]),
    temperature=st.sampled_from([1.0, 0.5, 1.7]),
)
@example(b=2, t=3, h=4, v=18, chunk=1, seed=25445, ignore_frac=0.0, temperature=0.5)  # a log-prob near 0 at T = 0.5
def test_property_chunked_equals_naive_and_batch_invariant(b, t, h, v, chunk, seed, ignore_frac, temperature):
    hidden, weight, bias, targets = random_problem(b, t, h, v, seed=seed, ignore_frac=ignore_frac)
    lp, ent = chunked_token_log_probs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk,
                                      return_entropy=True)
    ref_lp, ref_ent = naive(hidden, weight, bias, targets, temperature)
    # fp32 rounds logsumexp to ~1e-7 of its magnitude, which a log-prob near 0 inherits in full (seen: lse ~ 18 at
    # T = 0.5, log-prob -8.0e-5 vs -7.9e-5): the absolute tolerance grows with the largest |log-prob|
    atol = 1e-6 + 1e-7 * float(ref_lp.abs().max())
    close(lp, ref_lp, atol=atol)
    close(ent, ref_ent, atol=atol)
    ignored = targets == IGNORE_INDEX
    assert bool((lp[ignored] == 0).all()) and bool((ent[ignored] == 0).all())
    assert bool((lp[~ignored] <= 0).all()) and bool((ent[~ignored] >= -1e-6).all())
    # batching invariance: each row alone gives the same numbers
    for i in range(b):
        row = chunked_token_log_probs(hidden[i:i + 1], weight, targets[i:i + 1], bias=bias, temperature=temperature,
                                      chunk_size=chunk)
        close(row, lp[i:i + 1])


# --- model_token_log_probs ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peaked(tokenizer):
    """The tiny model with a 30x larger embedding/head so its next-token distributions are far from uniform."""
    from lit_llm.models import tiny_model

    model = tiny_model(tokenizer, seed=1)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    return model


def naive_model_log_probs(model, ids, temperature=1.0):
    """Per-row reference on an unpadded 1-D row: log p(x_t | x_<t) from model(ids).logits, 0 at t=0."""
    logits = model(ids[None]).logits[0]
    lp = naive_token_log_probs(logits[:-1], ids[1:], temperature=temperature)
    return torch.cat([torch.zeros(1), lp])


ROWS = [[1, 503, 2050, 17, 9, 1200, 33], [44, 45, 46], [7000, 13, 2]]


def left_pad(rows, pad_id):
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = torch.tensor(r)
        mask[i, t - len(r):] = 1
    return ids, mask


def test_model_log_probs_unpadded_matches_logits(peaked):
    ids = torch.tensor(ROWS[0])
    with torch.no_grad():
        lp = model_token_log_probs(peaked, ids[None], torch.ones(1, len(ids)), temperature=0.7, chunk_size=3)
        ref = naive_model_log_probs(peaked, ids, temperature=0.7)
    assert lp.shape == (1, len(ids)) and lp.dtype == torch.float32
    assert lp[0, 0].item() == 0.0
    close(lp[0], ref)
    assert ref[1:].std() > 1.0  # the fixture is peaked enough for the comparison to mean something


@pytest.mark.parametrize("pad_id", [0, 2])  # 2 = SmolLM2's eos == pad id: padding comes from the mask only
def test_model_log_probs_left_padded_equals_per_row(peaked, pad_id):
    ids, mask = left_pad(ROWS, pad_id)
    with torch.no_grad():
        lp, ent = model_token_log_probs(peaked, ids, mask, chunk_size=4, return_entropy=True)
        for i, r in enumerate(ROWS):
            r = torch.tensor(r)
            n = len(r)
            close(lp[i, -n:], naive_model_log_probs(peaked, r))
            assert torch.equal(lp[i, :-n], torch.zeros(ids.shape[1] - n))
            assert ent[i, -n] == 0.0 and torch.equal(ent[i, :-n], torch.zeros(ids.shape[1] - n))
            logits = peaked(r[None]).logits[0, :-1]
            close(ent[i, -n + 1:], naive_entropy(logits, r[1:]))


def test_model_log_probs_right_padded(peaked):
    ids = torch.tensor([[44, 45, 46, 2, 2], [1, 503, 2050, 17, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        lp = model_token_log_probs(peaked, ids, mask)
    close(lp[0, :3], naive_model_log_probs(peaked, ids[0, :3]))
    assert torch.equal(lp[0, 3:], torch.zeros(2))
    close(lp[1], naive_model_log_probs(peaked, ids[1]))


def test_model_log_probs_gradient_matches_naive(peaked):
    ids, mask = left_pad(ROWS[:2], 2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))
    params = [peaked.get_output_embeddings().weight, peaked.model.layers[-1].mlp.down_proj.weight]
    lp = model_token_log_probs(peaked, ids, mask, chunk_size=5)
    got = torch.autograd.grad((lp * weights).sum(), params)
    ref = sum(((naive_model_log_probs(peaked, torch.tensor(r)) * weights[i, -len(r):]).sum()
               for i, r in enumerate(ROWS[:2])))
    want = torch.autograd.grad(ref, params)
    for a, b in zip(got, want):
        close_grad(a, b)


def test_model_log_probs_errors(peaked):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="attention_mask row 0 has holes"):
        model_token_log_probs(peaked, ids, torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        model_token_log_probs(peaked, ids, torch.ones(1, 2))
    with pytest.raises(ValueError, match="temperature must be a number > 0"):
        model_token_log_probs(peaked, ids, torch.ones(1, 3), temperature=0)
    peaked.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(NotImplementedError, match="final_logit_softcapping=30.0"):
            model_token_log_probs(peaked, ids, torch.ones(1, 3))
    finally:
        peaked.config.final_logit_softcapping = None


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_property_left_padding_invariance(peaked, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]
    ids, mask = left_pad(rows, 2)
    with torch.no_grad():
        lp = model_token_log_probs(peaked, ids, mask, chunk_size=3)
        for i, r in enumerate(rows):
            single = model_token_log_probs(peaked, torch.tensor([r]), torch.ones(1, len(r)), chunk_size=3)
            close(lp[i, ids.shape[1] - len(r):], single[0])
    assert torch.equal(lp[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert torch.equal(lp[:, 0], torch.zeros(len(rows)))


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_left_padded_matches_logits(real_model):
    model, tok = real_model
    rows = [tok("The capital of France is Paris.")["input_ids"], tok("2 + 2 = 4")["input_ids"]]
    ids, mask = left_pad(rows, tok.pad_token_id)
    with torch.no_grad():
        lp = model_token_log_probs(model, ids, mask, chunk_size=4)
        for i, r in enumerate(rows):
            close(lp[i, -len(r):], naive_model_log_probs(model, torch.tensor(r)), rtol=1e-5, atol=1e-4)
    assert lp[0, -1] > -1.0  # "." after "Paris" is likely under the real model


def test_model_log_probs_score_mask_scores_only_those_positions(peaked):
    ids, mask = left_pad(ROWS[:2], pad_id=2)
    score = torch.zeros_like(mask, dtype=torch.bool)
    score[:, -3:] = True  # the last three tokens of each row (a completion)
    with torch.no_grad():
        full = model_token_log_probs(peaked, ids, mask, temperature=0.7)
        part = model_token_log_probs(peaked, ids, mask, temperature=0.7, score_mask=score)
    close(part[:, -3:], full[:, -3:])
    assert torch.count_nonzero(part[:, :-3]) == 0
    with pytest.raises(ValueError, match="score_mask must have the shape of input_ids"):
        model_token_log_probs(peaked, ids, mask, score_mask=score[:, 1:])


# --- completion_log_probs (GRPO micro-batch layout, shared prompts) -------------------------------------------------


def _prompt_completion_batch(prompts, completions, index, pad_id=0):
    p_ids, p_mask = left_pad(prompts, pad_id)
    width = max(len(c) for c in completions)
    c_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    c_mask = torch.zeros(len(completions), width, dtype=torch.bool)
    for i, c in enumerate(completions):
        c_ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        c_mask[i, :len(c)] = True
    return p_ids, p_mask.bool(), c_ids, c_mask, torch.tensor(index, dtype=torch.long)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_completion_log_probs_equal_per_row_logits_and_gradients(tiny, data):
    """Both modes == the unpadded row's ``model(ids).logits`` (values, entropies, parameter gradients).

    On the tiny random model (near-uniform next-token distributions): the peaked one's gradients are ~1e-5 and
    dominated by fp32 cancellation in ``onehot - p``."""
    peaked = tiny
    token = st.integers(3, 8000)
    n_prompts = data.draw(st.integers(1, 3))
    prompts = [data.draw(st.lists(token, min_size=1, max_size=6)) for _ in range(n_prompts)]
    index = data.draw(st.lists(st.integers(0, n_prompts - 1), min_size=1, max_size=6))
    completions = [data.draw(st.lists(token, min_size=1, max_size=5)) for _ in index]
    temperature = data.draw(st.sampled_from([1.0, 0.7]))
    batch = _prompt_completion_batch(prompts, completions, index)
    params = [p for p in peaked.parameters()]
    peaked.zero_grad()
    expected_lp, expected_ent = [], []
    for j, c in zip(index, completions):  # reference: one unpadded row at a time, full logits
        row = torch.tensor(prompts[j] + c)
        logits = peaked(row[None]).logits[0, len(prompts[j]) - 1:-1]
        expected_lp.append(naive_token_log_probs(logits, row[len(prompts[j]):], temperature=temperature))
        expected_ent.append(naive_entropy(logits, row[len(prompts[j]):], temperature))
    torch.cat(expected_lp).sum().add(torch.cat(expected_ent).sum()).backward()
    expected_grads = [p.grad.clone() for p in params]
    for share in (True, False):
        peaked.zero_grad()
        lp, ent = completion_log_probs(peaked, *batch, share_prompts=share, temperature=temperature, chunk_size=3,
                                       return_entropy=True)
        mask = batch[3]
        close(lp[mask], torch.cat(expected_lp).detach(), rtol=1e-4, atol=1e-4)
        close(ent[mask], torch.cat(expected_ent).detach(), rtol=1e-4, atol=1e-4)
        assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
        (lp.sum() + ent.sum()).backward()
        for p, g in zip(params, expected_grads):
            # + 1e-8: q/k gradients are exactly 0 with a one-token context, ~1e-10 by another summation order
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4 * float(g.abs().max()) + 1e-8)


def test_completion_log_probs_errors(peaked):
    p_ids, p_mask, c_ids, c_mask, index = _prompt_completion_batch([[5, 6], [7]], [[8, 9], [10]], [0, 1])
    with pytest.raises(ValueError, match="left-padded"):
        completion_log_probs(peaked, p_ids.flip(1), p_mask.flip(1), c_ids, c_mask, index)
    with pytest.raises(ValueError, match="right-padded"):
        completion_log_probs(peaked, p_ids, p_mask, c_ids, c_mask.flip(1), index)
    with pytest.raises(ValueError, match=r"prompt_index must lie in \[0, 2\)"):
        completion_log_probs(peaked, p_ids, p_mask, c_ids, c_mask, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="prompt_index"):
        completion_log_probs(peaked, p_ids, p_mask, c_ids, c_mask, index[:1])
    with pytest.raises(ValueError, match="integer row indices"):
        completion_log_probs(peaked, p_ids, p_mask, c_ids, c_mask, index.float())
    with pytest.raises(ValueError, match="no completion to score"):
        completion_log_probs(peaked, p_ids, p_mask, c_ids[:, :0], c_mask[:, :0], index)
    with pytest.raises(ValueError, match="no completion to score"):
        completion_log_probs(peaked, p_ids, p_mask, c_ids[:0], c_mask[:0], index[:0])


@pytest.mark.parametrize("share_prompts", [True, False])
def test_completion_log_probs_ignore_padding_ids(peaked, share_prompts):
    """Padding is read from the masks: any id there (even one outside the vocabulary) gives the same numbers."""
    batch = _prompt_completion_batch([[5, 6, 7], [8]], [[9, 10, 11], [12]], [0, 1])
    p_ids, p_mask, c_ids, c_mask, index = batch
    with torch.no_grad():
        lp = completion_log_probs(peaked, *batch, share_prompts=share_prompts)
        odd = completion_log_probs(peaked, p_ids.masked_fill(~p_mask, -100), p_mask, c_ids.masked_fill(~c_mask, 10**6),
                                   c_mask, index, share_prompts=share_prompts)
    assert torch.equal(lp, odd)


def test_completion_log_probs_need_a_cache_when_sharing(tokenizer):
    """Under gradient checkpointing in training mode HF turns the cache off: a clear error, and the unshared mode."""
    from lit_llm.models import tiny_model

    model = tiny_model(tokenizer)
    model.gradient_checkpointing_enable()
    model.train()
    batch = _prompt_completion_batch([[5, 6]], [[8, 9], [10]], [0, 0])
    with pytest.raises(RuntimeError, match="share_prompts=False"):
        completion_log_probs(model, *batch)
    assert completion_log_probs(model, *batch, share_prompts=False).shape == (2, 2)
