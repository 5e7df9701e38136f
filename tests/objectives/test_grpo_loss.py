"""GRPO advantages and clipped loss against hand computations; normalisation invariance; KL; errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.objectives import compute_advantages, effective_completion_mask, grpo_loss

# ---------------------------------------------------------------------------------------------------------------------
# Advantages


def test_advantages_group_with_zero_std_group():
    # Groups of 2: [1, 0], [0, 1], [0.5, 0.5]. Mean 0.5, unbiased std sqrt(0.5) = 0.70710678 for the first two;
    # A = ±0.5 / (0.70710678 + 1e-4) = ±0.70700680. The third group has std 0 -> exactly 0.
    adv, stats = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]), 2)
    a = 0.7070068
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0]), atol=1e-6, rtol=0)
    assert adv[4].item() == 0.0 and adv[5].item() == 0.0
    assert stats["frac_reward_zero_std"].item() == pytest.approx(1 / 3)
    assert stats["reward_mean"].item() == pytest.approx(0.5)
    # batch deviations ±0.5 (x4), 0 (x2): sum sq 1.0 / (6 - 1) = 0.2 -> std 0.4472136
    assert stats["reward_std"].item() == pytest.approx(0.4472136, abs=1e-6)
    assert stats["reward_group_std_mean"].item() == pytest.approx(2 * 0.70710678 / 3, abs=1e-6)


def test_advantages_batch_and_none_scaling():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    adv, _ = compute_advantages(rewards, 2, scale_rewards="batch")
    a = 1.1177840  # 0.5 / (0.4472136 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0]), atol=1e-6, rtol=0)
    adv, _ = compute_advantages(rewards, 2, scale_rewards="none")
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]


def test_advantages_group_of_four():
    # [1, 0, 0, 0]: mean 0.25, unbiased var (0.75^2 + 3 * 0.25^2) / 3 = 0.25 -> std 0.5.
    adv, stats = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0]), 4)
    torch.testing.assert_close(
        adv, torch.tensor([1.4997001, -0.4999000, -0.4999000, -0.4999000, 0, 0, 0, 0]), atol=1e-6, rtol=0
    )
    assert stats["frac_reward_zero_std"].item() == 0.5


def test_advantages_zero_std_exact_for_inexact_floats():
    adv, stats = compute_advantages(torch.tensor([0.1, 0.1, 0.1]), 3)
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert stats["frac_reward_zero_std"].item() == 1.0


@pytest.mark.parametrize(
    ("rewards", "g", "kwargs", "match"),
    [
        (torch.ones(4), 1, {}, "num_generations must be an integer >= 2"),
        (torch.ones(5), 2, {}, "rewards has 5 entries, not a positive multiple of num_generations=2"),
        (torch.ones(2, 2), 2, {}, "rewards must be a 1-D tensor"),
        (torch.tensor([1.0, float("nan")]), 2, {}, r"non-finite values at sample indices \[1\]"),
        (torch.ones(4), 2, {"scale_rewards": "std"}, "Unknown scale_rewards 'std'"),
    ],
)
def test_advantages_errors(rewards, g, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(rewards, g, **kwargs)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 5),
    st.integers(1, 4),
    st.sampled_from(["group", "batch", "none"]),
    st.data(),
)
def test_advantages_sum_to_zero_per_group(g, prompts, scale, data):
    vals = data.draw(st.lists(st.integers(-16, 16), min_size=g * prompts, max_size=g * prompts))
    rewards = torch.tensor(vals, dtype=torch.float32) / 4  # multiples of 0.25, like real rewards
    adv, stats = compute_advantages(rewards, g, scale_rewards=scale)
    groups = adv.view(prompts, g)
    assert groups.sum(-1).abs().max().item() < 1e-5
    r = rewards.view(prompts, g)
    const = (r == r[:, :1]).all(-1)
    assert (groups[const] == 0).all()
    assert stats["frac_reward_zero_std"].item() == pytest.approx(const.float().mean().item())
    if scale == "group" and (~const).any():
        std = r[~const].std(-1)
        torch.testing.assert_close(groups[~const].std(-1), std / (std + 1e-4), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Loss: 2 groups of 2, T = 5 (positions 0-1 prompt, 2-4 completion, right-padded within the completion).
# Token counts 3, 1, 2, 3; row 3 is truncated (hit max_new_tokens).

MASK = torch.tensor(
    [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
    dtype=torch.bool,
)
TRUNC = torch.tensor([False, False, False, True])
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5])
OLD = torch.full((4, 5), -1.0)


def on_policy_loss(loss_type, **kw):
    lp = OLD.clone().requires_grad_(True)
    loss, m = grpo_loss(lp, OLD, ADV, MASK, loss_type=loss_type, max_completion_length=3, truncated=TRUNC, **kw)
    return lp, loss, m


# On-policy, per-token loss = -A: row sums -3, +1, -1, +1.5; row means -1, 1, -0.5, 0.5.
@pytest.mark.parametrize(
    ("loss_type", "mask_trunc", "expected", "denom"),
    [
        ("dapo", False, -1.5 / 9, 9),
        ("bnpo", False, -1.5 / 9, 9),
        ("grpo", False, 0.0, 4),
        ("dr_grpo", False, -1.5 / 12, 12),  # B * max_completion_length = 4 * 3
        ("dapo", True, -3.0 / 6, 6),  # row 3 leaves numerator and denominator
        ("bnpo", True, -3.0 / 6, 6),
        ("grpo", True, (-1 + 1 - 0.5 + 0) / 4, 4),  # the empty row still counts as a sequence (TRL)
        ("dr_grpo", True, -3.0 / 12, 12),
    ],
)
def test_loss_types_hand_values(loss_type, mask_trunc, expected, denom):
    _, loss, m = on_policy_loss(loss_type, mask_truncated_completions=mask_trunc)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["normalizer"].item() == denom
    assert m["num_tokens"].item() == (6 if mask_trunc else 9)


def test_dapo_global_count_and_gradient():
    lp, loss, m = on_policy_loss("dapo", mask_truncated_completions=True, num_items_in_batch=12)
    assert loss.item() == pytest.approx(-3.0 / 12, abs=1e-6)
    loss.backward()
    # d(-ratio * A)/dlogp = -A at ratio 1, divided by 12; truncated row 3 and non-completion tokens get 0.
    expected = torch.zeros(4, 5)
    expected[0, 2:] = -1 / 12
    expected[1, 2] = 1 / 12
    expected[2, 2:4] = -0.5 / 12
    torch.testing.assert_close(lp.grad, expected, atol=1e-7, rtol=0)


def test_on_policy_ratio_one_no_clipping():
    _, _, m = on_policy_loss("dapo")
    assert m["ratio_mean"].item() == 1.0 and m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
    for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert m[k].item() == 0.0
    assert "kl" not in m


def off_policy_log_probs():
    lp = OLD.clone()
    lp[0, 2] += math.log(1.5)  # A = 1 > 0, ratio 1.5 -> clipped high at 1 + eps_high
    lp[1, 2] += math.log(0.5)  # A = -1 < 0, ratio 0.5 -> clipped low at 0.8
    lp[2, 3] += math.log(1.1)  # A = 0.5, ratio 1.1 inside the region
    return lp.requires_grad_(True)


def test_clipping_hand_values():
    lp = off_policy_log_probs()
    loss, m = grpo_loss(lp, OLD, ADV, MASK, loss_type="dapo")
    # rows: -(1.2 + 1 + 1) = -3.2, +0.8, -(0.5 + 0.55) = -1.05, +1.5 -> S = -1.95 over 9 tokens
    assert loss.item() == pytest.approx(-1.95 / 9, abs=1e-6)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 9)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 9)
    assert m["clip_ratio/region_mean"].item() == pytest.approx(2 / 9)
    assert m["ratio_mean"].item() == pytest.approx(9.1 / 9, abs=1e-6)
    assert m["ratio_min"].item() == pytest.approx(0.5) and m["ratio_max"].item() == pytest.approx(1.5)
    loss.backward()
    assert lp.grad[0, 2].item() == 0.0 and lp.grad[1, 2].item() == 0.0  # clipped: no gradient
    assert lp.grad[2, 3].item() == pytest.approx(-0.55 / 9, abs=1e-7)  # -ratio * A / 9
    loss, _ = grpo_loss(off_policy_log_probs(), OLD, ADV, MASK, loss_type="grpo")
    assert loss.item() == pytest.approx((-3.2 / 3 + 0.8 - 1.05 / 2 + 1.5 / 3) / 4, abs=1e-6)
    loss, _ = grpo_loss(off_policy_log_probs(), OLD, ADV, MASK, loss_type="dr_grpo", max_completion_length=4)
    assert loss.item() == pytest.approx(-1.95 / 16, abs=1e-6)
    # clip-higher (DAPO): the upper bound moves to 1.28
    loss, m = grpo_loss(off_policy_log_probs(), OLD, ADV, MASK, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-2.03 / 9, abs=1e-6)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 9)


def test_kl_term():
    lp = OLD.clone().requires_grad_(True)
    loss, m = grpo_loss(lp, OLD, ADV, MASK, beta=0.1, ref_log_probs=OLD.clone(), truncated=TRUNC,
                        mask_truncated_completions=True)
    assert m["kl"].item() == 0.0
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    # ref = logp - 1: k3 = exp(-1) per token -> (-3 + 6 * 0.1 * 0.36787944) / 6
    loss, m = grpo_loss(lp, OLD, ADV, MASK, beta=0.1, ref_log_probs=OLD - 1, truncated=TRUNC,
                        mask_truncated_completions=True)
    assert m["kl"].item() == pytest.approx(0.36787944, abs=1e-6)
    assert loss.item() == pytest.approx(-0.5 + 0.036787944, abs=1e-6)
    # beta = 0 with a reference: reported, not added
    loss, m = grpo_loss(lp, OLD, ADV, MASK, ref_log_probs=OLD + 1)
    assert m["kl"].item() == pytest.approx(0.71828183, abs=1e-6)
    assert loss.item() == pytest.approx(-1.5 / 9, abs=1e-6)


def test_kl_positive_after_an_update():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    ids = torch.randint(0, 7, (4, 5))

    def logp():
        return logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)

    ref = logp().detach()
    loss, m = grpo_loss(logp(), ref, ADV, MASK, beta=0.04, ref_log_probs=ref)
    assert m["kl"].item() == 0.0
    loss.backward()
    with torch.no_grad():
        logits -= 1.0 * logits.grad
    _, m = grpo_loss(logp(), ref, ADV, MASK, beta=0.04, ref_log_probs=ref)
    assert m["kl"].item() > 1e-4


def test_entropy_metric_and_masked_garbage():
    lp = OLD.clone()
    lp[3, 0] = float("-inf")  # prompt position: never exponentiated
    lp.requires_grad_(True)
    ent = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    loss, m = grpo_loss(lp, OLD, ADV, MASK, entropy=ent)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    # masked entropies: row0 2+3+4, row1 7, row2 12+13, row3 17+18+19 -> 95 / 9
    assert m["entropy"].item() == pytest.approx(95 / 9, abs=1e-5)


def test_split_micro_batches_equal_full_batch():
    lp = off_policy_log_probs().detach()
    for loss_type, kw in (("dapo", {"num_items_in_batch": 6}), ("grpo", {"num_sequences_in_batch": 4}),
                          ("dr_grpo", {"num_sequences_in_batch": 4})):
        full, _ = grpo_loss(lp, OLD, ADV, MASK, loss_type=loss_type, max_completion_length=3, truncated=TRUNC,
                            mask_truncated_completions=True)
        parts = [
            grpo_loss(lp[s], OLD[s], ADV[s], MASK[s], loss_type=loss_type, max_completion_length=3,
                      truncated=TRUNC[s], mask_truncated_completions=True, **kw)[0]
            for s in (slice(0, 2), slice(2, 4))
        ]
        assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6), loss_type
    # bnpo is local by definition: micro-batch means (-2.4/4, -1.05/2) differ from the full mean -2.85/6
    parts = [grpo_loss(lp[s], OLD[s], ADV[s], MASK[s], loss_type="bnpo", truncated=TRUNC[s],
                       mask_truncated_completions=True)[0].item() for s in (slice(0, 2), slice(2, 4))]
    assert parts == pytest.approx([-2.4 / 4, -1.05 / 2], abs=1e-6)


def test_effective_completion_mask():
    assert effective_completion_mask(MASK, TRUNC, True).sum().item() == 6
    assert effective_completion_mask(MASK, TRUNC, False).sum().item() == 9


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, "Unknown loss_type 'ppo'"),
        ({"loss_type": "dr_grpo"}, "needs max_completion_length"),
        ({"beta": 0.1}, "needs ref_log_probs"),
        ({"mask_truncated_completions": True}, "needs truncated"),
        ({"mask_truncated_completions": True, "truncated": torch.zeros(3, dtype=torch.bool)}, r"truncated must be"),
        ({"epsilon": -0.1}, "epsilon must be a finite number >= 0"),
        ({"num_items_in_batch": 4}, "num_items_in_batch=4 is smaller than this micro-batch's own count 9"),
        ({"loss_type": "grpo", "num_sequences_in_batch": 2}, "num_sequences_in_batch=2 is smaller"),
    ],
)
def test_loss_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_loss(OLD, OLD, ADV, MASK, **kwargs)


def test_loss_input_errors():
    with pytest.raises(ValueError, match=r"advantages must be a \[B\]=4 tensor"):
        grpo_loss(OLD, OLD, ADV[:, None], MASK)
    with pytest.raises(ValueError, match="advantages holds NaN"):
        grpo_loss(OLD, OLD, torch.tensor([1.0, float("nan"), 0, 0]), MASK)
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        grpo_loss(OLD, OLD[:, :4], ADV, MASK)
    with pytest.raises(ValueError, match="completion_mask has shape"):
        grpo_loss(OLD, OLD, ADV, MASK[:3])


@st.composite
def rollouts(draw):
    b = draw(st.integers(2, 6))
    t = draw(st.integers(1, 6))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    f = st.floats(-3.0, 0.0, width=32)
    lp = torch.tensor(draw(st.lists(f, min_size=b * t, max_size=b * t))).reshape(b, t)
    old = torch.tensor(draw(st.lists(f, min_size=b * t, max_size=b * t))).reshape(b, t)
    adv = torch.tensor(draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=b, max_size=b)))
    trunc = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    return lp, old, adv, mask, trunc, draw(st.integers(1, b - 1))


@settings(max_examples=60, deadline=None)
@given(rollouts(), st.sampled_from(["dapo", "grpo", "dr_grpo"]), st.booleans())
def test_split_invariance(batch, loss_type, mask_trunc):
    lp, old, adv, mask, trunc, split = batch
    kw = dict(loss_type=loss_type, max_completion_length=7, truncated=trunc, mask_truncated_completions=mask_trunc,
              epsilon_high=0.28)
    full, _ = grpo_loss(lp, old, adv, mask, **kw)
    n_tok = effective_completion_mask(mask, trunc, mask_trunc).sum()
    total = sum(
        grpo_loss(lp[s], old[s], adv[s], mask[s], **{**kw, "truncated": trunc[s]}, num_items_in_batch=n_tok,
                  num_sequences_in_batch=lp.shape[0])[0]
        for s in (slice(0, split), slice(split, None))
    )
    assert math.isclose(float(total), full.item(), rel_tol=1e-5, abs_tol=1e-5)
