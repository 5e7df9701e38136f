"""Tests of LLMMaskedCategorical and LogProbDistribution against hand-computed values on a 3-token vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.distributions import LLMMaskedCategorical, LogProbDistribution

LN2, LN3 = math.log(2.0), math.log(3.0)

# Position 0: logits [0, ln2, ln3] -> p = [1/6, 2/6, 3/6]
# Position 1: logits [ln3, 0, 0]   -> p = [3/5, 1/5, 1/5]
# Position 2: logits [5, 5, 5]     -> p = [1/3, 1/3, 1/3]
LOGITS = torch.tensor([[[0.0, LN2, LN3], [LN3, 0.0, 0.0], [5.0, 5.0, 5.0]]])  # [B=1, T=3, V=3]
# entropies written by hand:
H0 = (1 / 6) * math.log(6) + (2 / 6) * math.log(3) + (3 / 6) * math.log(2)  # 1.011404
H1 = (3 / 5) * math.log(5 / 3) + 2 * (1 / 5) * math.log(5)  # 0.950271
H2 = math.log(3)  # 1.098612


def approx_list(t: torch.Tensor, expected: list, abs_tol: float = 1e-6) -> None:
    assert t.flatten().tolist() == pytest.approx(expected, abs=abs_tol)


def test_hand_numbers_are_right():
    assert H0 == pytest.approx(1.0114043, abs=1e-6)
    assert H1 == pytest.approx(0.9502705, abs=1e-6)


def test_log_prob_all_positions():
    dist = LLMMaskedCategorical(LOGITS, torch.ones(1, 3, dtype=torch.bool))
    lp = dist.log_prob(torch.tensor([[2, 0, 1]]))
    assert lp.dtype == torch.float32 and lp.shape == (1, 3)
    approx_list(lp, [math.log(3 / 6), math.log(3 / 5), math.log(1 / 3)])
    approx_list(dist.entropy(), [H0, H1, H2])
    approx_list(dist.probs, [1 / 6, 2 / 6, 3 / 6, 3 / 5, 1 / 5, 1 / 5, 1 / 3, 1 / 3, 1 / 3])


def test_masked_positions_give_zero_and_accept_ignore_index():
    mask = torch.tensor([[True, False, True]])
    dist = LLMMaskedCategorical(LOGITS, mask)
    approx_list(dist.log_prob(torch.tensor([[1, -100, 0]])), [math.log(2 / 6), 0.0, math.log(1 / 3)])
    # any id at a masked position, even out of range, is ignored
    approx_list(dist.log_prob(torch.tensor([[1, 12345, 0]])), [math.log(2 / 6), 0.0, math.log(1 / 3)])
    approx_list(dist.entropy(), [H0, 0.0, H2])
    assert dist.mode.tolist() == [[2, -100, 0]]  # ties at position 2 resolve to the first index
    assert torch.equal(dist.deterministic_sample, dist.mode)
    assert dist.logits is LOGITS  # the original logits, no masked copy


def test_custom_ignore_index():
    dist = LLMMaskedCategorical(LOGITS, torch.tensor([[False, True, True]]), ignore_index=-1)
    assert dist.mode.tolist() == [[-1, 0, 0]]
    approx_list(dist.log_prob(torch.tensor([[-1, 1, 2]])), [0.0, math.log(1 / 5), math.log(1 / 3)])


def test_gradients_hand_values_and_no_gradient_at_masked_positions():
    logits = LOGITS.clone().requires_grad_()
    dist = LLMMaskedCategorical(logits, torch.tensor([[True, False, True]]))
    dist.log_prob(torch.tensor([[2, -100, 0]])).sum().backward()
    # d log p_y / d z = onehot(y) - p
    approx_list(logits.grad[0, 0], [-1 / 6, -2 / 6, 1 - 3 / 6])
    approx_list(logits.grad[0, 1], [0.0, 0.0, 0.0])
    approx_list(logits.grad[0, 2], [2 / 3, -1 / 3, -1 / 3])
    logits.grad = None
    LLMMaskedCategorical(logits, torch.tensor([[False, True, True]])).entropy().sum().backward()
    approx_list(logits.grad[0, 0], [0.0, 0.0, 0.0])
    # dH/dz_k = -p_k (log p_k + H); at the uniform position 2 it is 0
    p1 = [3 / 5, 1 / 5, 1 / 5]
    approx_list(logits.grad[0, 1], [-p * (math.log(p) + H1) for p in p1])
    approx_list(logits.grad[0, 2], [0.0, 0.0, 0.0])


def test_sample_frequencies_and_masking():
    torch.manual_seed(0)
    mask = torch.tensor([[True, False, True]])
    dist = LLMMaskedCategorical(LOGITS, mask)
    s = dist.sample((30_000,))
    assert s.shape == (30_000, 1, 3) and s.dtype == torch.long
    assert bool((s[:, 0, 1] == -100).all())
    freq0 = torch.bincount(s[:, 0, 0], minlength=3).float() / s.shape[0]
    approx_list(freq0, [1 / 6, 2 / 6, 3 / 6], abs_tol=0.015)
    freq2 = torch.bincount(s[:, 0, 2], minlength=3).float() / s.shape[0]
    approx_list(freq2, [1 / 3, 1 / 3, 1 / 3], abs_tol=0.015)
    assert dist.sample().shape == (1, 3)
    # samples score back to finite log-probs, with 0 at masked positions
    lp = dist.log_prob(s)
    assert lp.shape == (30_000, 1, 3) and bool((lp[:, 0, 1] == 0).all()) and bool(torch.isfinite(lp).all())


def test_masked_logits_view():
    dist = LLMMaskedCategorical(LOGITS, torch.tensor([[True, False, True]]))
    ml = dist.masked_logits
    low = torch.finfo(torch.float32).min
    assert ml[0, 1].tolist() == [low, low, low]
    assert torch.equal(ml[0, [0, 2]], LOGITS[0, [0, 2]])


def test_bf16_logits_give_fp32():
    dist = LLMMaskedCategorical(LOGITS.bfloat16(), torch.ones(1, 3, dtype=torch.bool))
    lp = dist.log_prob(torch.tensor([[2, 0, 1]]))
    assert lp.dtype == torch.float32
    approx_list(lp, [math.log(3 / 6), math.log(3 / 5), math.log(1 / 3)], abs_tol=1e-2)


def test_errors():
    with pytest.raises(ValueError, match=r"mask shape \(1, 2\) must equal logits.shape\[:-1\] \(1, 3\)"):
        LLMMaskedCategorical(LOGITS, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="Token-level masks"):
        LLMMaskedCategorical(LOGITS, torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool"):
        LLMMaskedCategorical(LOGITS, torch.ones(1, 3))
    with pytest.raises(ValueError, match="logits must be a floating-point tensor"):
        LLMMaskedCategorical(torch.ones(1, 3, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    dist = LLMMaskedCategorical(LOGITS, torch.tensor([[True, False, True]]))
    with pytest.raises(ValueError, match=r"unmasked position \(0, 2\) is -100"):
        dist.log_prob(torch.tensor([[0, 0, -100]]))
    with pytest.raises(ValueError, match=r"is 3, outside the vocabulary \[0, 3\)"):
        dist.log_prob(torch.tensor([[3, 0, 0]]))
    with pytest.raises(ValueError, match="value must be an integer tensor"):
        dist.log_prob(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        dist.log_prob(torch.zeros(1, 4, dtype=torch.long))


def test_integer_mask_is_accepted():
    dist = LLMMaskedCategorical(LOGITS, torch.tensor([[1, 0, 1]]))
    assert dist.mask.dtype == torch.bool
    approx_list(dist.entropy(), [H0, 0.0, H2])


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 6), v=st.integers(2, 7), seed=st.integers(0, 10_000))
def test_property_matches_torch_categorical_on_unmasked(b, t, v, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * 3
    mask = torch.rand(b, t, generator=g) < 0.6
    value = torch.randint(0, v, (b, t), generator=g)
    ref = torch.distributions.Categorical(logits=logits)
    dist = LLMMaskedCategorical(logits, mask)
    lp = dist.log_prob(value.masked_fill(~mask, -100))
    torch.testing.assert_close(lp, torch.where(mask, ref.log_prob(value), 0.0))
    torch.testing.assert_close(dist.entropy(), torch.where(mask, ref.entropy(), 0.0))
    assert torch.equal(dist.mode, torch.where(mask, logits.argmax(-1), -100))
    assert bool(((dist.sample() == -100) == ~mask).all())
    # sum of log-probs over the vocabulary at each unmasked position is 0 in log-space (probs sum to 1)
    all_lp = torch.stack([dist.log_prob(torch.full((b, t), k).masked_fill(~mask, -100)) for k in range(v)], -1)
    torch.testing.assert_close(all_lp.exp().sum(-1)[mask], torch.ones(int(mask.sum())))


# --- LogProbDistribution --------------------------------------------------------------------------------------------


def test_log_prob_distribution_returns_stored_values_masked():
    stored = torch.tensor([[0.0, math.log(1 / 6), math.log(2 / 6), math.log(3 / 6)]])
    dist = LogProbDistribution(stored, torch.tensor([[False, True, False, True]]))
    approx_list(dist.log_prob(torch.tensor([[7, 8, 9, 10]])), [0.0, math.log(1 / 6), 0.0, math.log(1 / 2)])
    unmasked = LogProbDistribution(stored)
    assert torch.equal(unmasked.log_prob(torch.zeros(1, 4, dtype=torch.long)), stored)
    assert dist.batch_shape == (1, 4)


def test_log_prob_distribution_errors():
    dist = LogProbDistribution(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"value shape \(2, 4\) must equal the stored log_probs shape \(2, 3\)"):
        dist.log_prob(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="LogProbDistribution.sample"):
        dist.sample()
    with pytest.raises(NotImplementedError, match="LogProbDistribution.entropy"):
        dist.entropy()
    with pytest.raises(ValueError, match=r"mask shape \(2, 2\) must equal log_probs.shape \(2, 3\)"):
        LogProbDistribution(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="log_probs must be a floating-point tensor"):
        LogProbDistribution(torch.zeros(2, 3, dtype=torch.long))


def test_log_prob_distribution_keeps_gradient():
    stored = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    dist = LogProbDistribution(stored, torch.tensor([[True, False]]))
    dist.log_prob(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    assert stored.grad.tolist() == [[1.0, 0.0]]
