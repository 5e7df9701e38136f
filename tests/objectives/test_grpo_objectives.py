"""GRPO-family objectives (issue 15): GSPO's sequence ratio, CISPO, RLOO / REINFORCE++ advantages, the entropy bonus
and the rollout (sampler/trainer) correction, each against a float64 reference written from the papers' formulas
(row by row, token by token: it never calls the code under test), plus their properties."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.objectives import GRPOObjective, compute_advantages, grpo_loss, rollout_correction_weights
from lit_llm.objectives.correction import mismatch_metrics

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
LEVELS = ("token", "sequence")
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ESTIMATORS = (("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("rloo", "group"), ("rloo", "batch"),
              ("rloo", "none"), ("reinforce_plus_plus", "batch"), ("reinforce_plus_plus", "none"))


# ---------------------------------------------------------------------------------------------------------------------
# Float64 references, straight from the formulas


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_advantages(rewards: list[float], g: int, estimator: str, scale: str, eps: float = 1e-4) -> list[float]:
    """GRPO: r - mean(group); RLOO: r - mean of the others; REINFORCE++: r - mean(group), whitened over the batch."""
    out, zero = [], []
    for k in range(0, len(rewards), g):
        grp = rewards[k:k + g]
        for i, r in enumerate(grp):
            if estimator == "rloo":
                base = sum(x for j, x in enumerate(grp) if j != i) / (g - 1)
            else:
                base = sum(grp) / g
            c = r - base
            if estimator != "reinforce_plus_plus" and scale == "group":
                c = c / (_std(grp) + eps)
            elif estimator != "reinforce_plus_plus" and scale == "batch":
                c = c / (_std(rewards) + eps)
            out.append(c)
            zero.append(max(grp) == min(grp))
    if estimator == "reinforce_plus_plus" and scale == "batch":
        mean, sd = sum(out) / len(out), _std(out)
        out = [(c - mean) / (sd + eps) for c in out]
    return [0.0 if z else c for c, z in zip(out, zero)]


def ref_loss(lp, old, rollout, adv, mask, trunc, ent, ref, *, loss_type, level, correction, eps=0.2, eps_high=None,
             beta=0.0, entropy_coef=0.0, clip_max=2.0, clip_min=None, max_len=5, mask_trunc=False):
    """The per-token surrogate of each paper, summed row by row in float64 scalars (autograd via ``lp``, ``ent``)."""
    eps_high = eps if eps_high is None else eps_high
    b, t = len(mask), len(mask[0])
    terms, counts = [], []
    for i in range(b):
        m0 = [bool(mask[i][j]) and not (mask_trunc and trunc[i]) for j in range(t)]
        w = [1.0] * t
        keep = list(m0)
        if correction != "none":
            logs = [old[i][j] - rollout[i][j] for j in range(t)]
            if correction.startswith("sequence"):
                s = sum(logs[j] for j in range(t) if m0[j])
                logs = [s] * t
            raw = [math.exp(x) for x in logs]
            if correction.endswith("truncate"):
                w = [min(x, clip_max) for x in raw]
            else:
                lo = 1 / clip_max if clip_min is None else clip_min
                keep = [m0[j] and lo <= raw[j] <= clip_max for j in range(t)]
                w = raw
        toks = [j for j in range(t) if keep[j]]
        if level == "sequence":
            s = sum((lp[i][j] - old[i][j] for j in toks), torch.zeros((), dtype=torch.float64)) / max(1, len(toks))
            ratios = {j: torch.exp(s) for j in toks}
        else:
            ratios = {j: torch.exp(lp[i][j] - old[i][j]) for j in toks}
        row = []
        for j in toks:
            r, a = ratios[j], adv[i]
            if loss_type == "cispo":
                pg = -torch.clamp(r, max=eps_high).detach() * a * lp[i][j]
            else:
                pg = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps_high) * a)
            d = ref[i][j] - lp[i][j]
            row.append(w[j] * pg + beta * (torch.exp(d) - d - 1) - entropy_coef * ent[i][j])
        terms.append(row)
        counts.append(len(toks))
    total = sum((x for row in terms for x in row), torch.zeros((), dtype=torch.float64))
    if loss_type == "grpo":
        return sum((sum(row, torch.zeros((), dtype=torch.float64)) / max(1, len(row)) for row in terms),
                   torch.zeros((), dtype=torch.float64)) / b
    if loss_type == "dr_grpo":
        return total / (b * max_len)
    return total / max(1, sum(counts))


# ---------------------------------------------------------------------------------------------------------------------
# Advantages


@pytest.mark.parametrize(("estimator", "scale"), ESTIMATORS)
def test_advantages_match_reference(estimator, scale):
    rewards = [1.0, 0.0, 0.25, 0.5, 2.0, 2.0, 2.0, 2.0, -1.0, 0.75, 0.0, 0.0]
    adv, _ = compute_advantages(torch.tensor(rewards), 4, scale_rewards=scale, advantage_estimator=estimator)
    expected = ref_advantages(rewards, 4, estimator, scale)
    torch.testing.assert_close(adv.double(), torch.tensor(expected, dtype=torch.float64), atol=2e-6, rtol=1e-6)
    assert adv[4:8].tolist() == [0.0] * 4  # constant group: exactly 0 under every estimator


def test_rloo_hand_values():
    # group [1, 0, 0]: r_i - mean(others) = 1 - 0, 0 - 0.5, 0 - 0.5
    adv, _ = compute_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, scale_rewards="none", advantage_estimator="rloo")
    assert adv.tolist() == [1.0, -0.5, -0.5]


def test_reinforce_plus_plus_hand_values():
    # groups [1, 0], [3, 3]: centred [0.5, -0.5, 0, 0]; batch std sqrt(0.5 / 3) = 0.40824829
    adv, _ = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale_rewards="batch",
                                advantage_estimator="reinforce_plus_plus")
    a = 0.5 / (0.40824829 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]), atol=1e-6, rtol=0)


def test_advantage_estimator_errors():
    with pytest.raises(ValueError, match="Unknown advantage_estimator 'ppo'"):
        compute_advantages(torch.ones(4), 2, advantage_estimator="ppo")
    with pytest.raises(ValueError, match="set scale_rewards to 'batch'"):
        compute_advantages(torch.ones(4), 2, advantage_estimator="reinforce_plus_plus")


# ---------------------------------------------------------------------------------------------------------------------
# Every loss x level x correction x estimator against the reference (values and gradients)

B, T, G = 4, 5, 2
MASK = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
TRUNC = torch.tensor([False, False, False, True])
REWARDS = [1.0, 0.0, 0.25, 0.75]


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 0.1
    lp = old + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 0.8  # ratios ~0.67-1.5: some clipped
    rollout = old + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 2.4  # weights ~0.3-3.3
    ent = torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    ref = old + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 0.4
    return lp, old, rollout, ent, ref


@pytest.mark.parametrize(("estimator", "scale"), ESTIMATORS)
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_matches_float64_reference(loss_type, level, correction, estimator, scale):
    lp0, old, rollout, ent0, ref = _inputs(sum(map(ord, loss_type + level + correction)))
    adv = torch.tensor(ref_advantages(REWARDS, G, estimator, scale), dtype=torch.float64)
    kw = dict(loss_type=loss_type, level=level, correction=correction, eps=0.2,
              eps_high=5.0 if loss_type == "cispo" else 0.28, beta=0.05, entropy_coef=0.01, clip_max=2.0,
              clip_min=None, max_len=4, mask_trunc=True)
    lp_r, ent_r = lp0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
    expected = ref_loss([list(r) for r in lp_r.unbind(0)], old.tolist(), rollout.tolist(), adv.tolist(),
                        MASK.tolist(), TRUNC.tolist(), [list(r) for r in ent_r.unbind(0)], ref.tolist(), **kw)
    (expected + 0 * (lp_r.sum() + ent_r.sum())).backward()  # every token may be masked: gradients of zero
    lp, ent = lp0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
    loss, m = grpo_loss(lp, old, adv, MASK, loss_type=loss_type, epsilon=0.2, epsilon_high=kw["eps_high"], beta=0.05,
                        ref_log_probs=ref, entropy=ent, entropy_coef=0.01, truncated=TRUNC,
                        mask_truncated_completions=True, max_completion_length=4, importance_sampling_level=level,
                        rollout_log_probs=rollout, rollout_correction=correction)
    loss.backward()
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12, rel=1e-10)
    torch.testing.assert_close(lp.grad, lp_r.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(ent.grad, ent_r.grad, atol=1e-12, rtol=1e-10)
    assert "mismatch/kl" in m and m["mismatch/kl"].item() >= 0
    if correction != "none":
        assert 0 <= m["rollout_correction/corrected_fraction"].item() <= 1


def test_reference_cases_exercise_clipping_and_correction():
    """The reference test's inputs do reach the clip region and the correction's bounds, and keep tokens inside
    them (else it would compare little)."""
    m0 = MASK & ~TRUNC[:, None]
    seeds = {sum(map(ord, a + b + c)) for a, b, c in itertools.product(LOSS_TYPES, LEVELS, CORRECTIONS)}
    clipped = outside = inside = 0
    for seed in seeds:
        lp, old, rollout, _, _ = _inputs(seed)
        r, w = torch.exp(lp - old)[m0], torch.exp(old - rollout)[m0]
        clipped += bool(((r > 1.28) | (r < 0.8)).any())
        outside += bool(((w > 2.0) | (w < 0.5)).any())
        inside += bool(((w <= 2.0) & (w >= 0.5)).any())
    assert min(clipped, outside, inside) >= 0.7 * len(seeds), (clipped, outside, inside, len(seeds))


def test_cispo_hand_values_and_gradient():
    # one token per row, logp = -1; ratios 1.5 (A = 1) and 10 (A = -1, capped at eps_max = 4)
    old = torch.tensor([[-1.0 - math.log(1.5)], [-1.0 - math.log(10.0)]])
    lp = torch.full((2, 1), -1.0, requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, m = grpo_loss(lp, old, torch.tensor([1.0, -1.0]), mask, loss_type="cispo", epsilon_high=4.0)
    # -(1.5 * 1 * -1) - (4 * -1 * -1) = 1.5 - 4 -> / 2 tokens
    assert loss.item() == pytest.approx((1.5 - 4.0) / 2, abs=1e-6)
    loss.backward()
    # the weight is stop-gradient: d/dlogp = -w * A / 2, also for the capped token (PPO clipping would give 0)
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.75], [2.0]]), atol=1e-6, rtol=0)
    assert m["clip_ratio/high_mean"].item() == 0.5 and m["clip_ratio/low_mean"].item() == 0.0


def test_gspo_sequence_ratio_hand_values():
    # row 0: token log-ratios log(2), 0 over two tokens -> s = sqrt(2); A = 1, eps_high 0.5 -> not clipped
    old = torch.zeros(1, 3)
    lp = torch.tensor([[math.log(2.0), 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, m = grpo_loss(lp, old, torch.tensor([1.0]), mask, loss_type="grpo", epsilon_high=0.5,
                        importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-math.sqrt(2.0), abs=1e-6)
    assert m["ratio_min"].item() == pytest.approx(math.sqrt(2.0)) == m["ratio_max"].item()
    loss.backward()
    # d(-s)/dlogp_t = -s / |y|
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.sqrt(2) / 2, -math.sqrt(2) / 2, 0.0]]), atol=1e-6,
                               rtol=0)


def test_rollout_correction_hand_values():
    old = torch.zeros(2, 3)
    rollout = torch.log(torch.tensor([[0.25, 1.0, 1.0], [1.0, 2.0, 1.0]]))  # weights old/rollout: 4, 1, 1 | 1, .5, 1
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w = rollout_correction_weights(old, rollout, mask, mode="token_truncate", clip_max=2.0)
    torch.testing.assert_close(w.weight, torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.5, 1.0]]))
    assert w.keep.equal(mask) and w.corrected.tolist() == [[True, False, False], [False, False, False]]
    w = rollout_correction_weights(old, rollout, mask, mode="token_mask", clip_max=2.0, clip_min=0.6)
    assert w.keep.tolist() == [[False, True, False], [True, False, True]]
    torch.testing.assert_close(w.weight, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]]))
    w = rollout_correction_weights(old, rollout, mask, mode="sequence_truncate", clip_max=3.0)  # 4 -> 3 | 0.5
    torch.testing.assert_close(w.weight, torch.tensor([[3.0, 3.0, 0.0], [0.5, 0.5, 0.5]]))
    w = rollout_correction_weights(old, rollout, mask, mode="sequence_mask", clip_max=3.0)  # lower bound 1/3
    assert w.keep.tolist() == [[False, False, False], [True, True, True]]
    # masked tokens leave the denominator: dapo's count drops from 5 to 3
    obj = GRPOObjective(rollout_correction="sequence_mask", rollout_correction_clip_max=3.0)
    assert obj.local_count(mask, None, old, rollout).item() == 3
    loss, m = obj(old.clone(), old, torch.tensor([1.0, 1.0]), mask, step_count=3, rollout_log_probs=rollout)
    assert m["num_tokens"].item() == 3 and loss.item() == pytest.approx(-0.5, abs=1e-6)  # 3 tokens of -1 * 0.5


def test_mismatch_metrics_k3():
    gen = torch.log(torch.tensor([[0.5, 0.25]]))
    train = torch.log(torch.tensor([[0.25, 0.25]]))
    m = mismatch_metrics(train, gen, torch.ones(1, 2, dtype=torch.bool))
    # r = 0.5, 1 -> k3 = 0.5 - 1 - log 0.5 = 0.19314718, 0 -> mean 0.09657359
    assert m["mismatch/kl"].item() == pytest.approx(0.09657359, abs=1e-6)
    assert m["mismatch/ratio_min"].item() == pytest.approx(0.5) and m["mismatch/ratio_max"].item() == pytest.approx(1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "cispo"}, "needs epsilon_high > 0"),
        ({"importance_sampling_level": "group"}, "Unknown importance_sampling_level"),
        ({"entropy_coef": 0.1}, "needs entropy"),
        ({"entropy_coef": -0.1}, "entropy_coef must be a finite number >= 0"),
        ({"rollout_correction": "token_truncate"}, "needs rollout_log_probs"),
        ({"rollout_correction": "tis"}, "Unknown rollout_correction 'tis'"),
        ({"rollout_correction": "token_truncate", "rollout_correction_clip_min": 0.5}, "only used by the mask modes"),
        ({"rollout_correction": "token_mask", "rollout_correction_clip_max": 0.5}, "clip_max must be a finite"),
    ],
)
def test_new_option_errors(kwargs, match):
    lp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        grpo_loss(lp, torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), **kwargs)


def test_entropy_coef_needs_entropy_with_grad():
    lp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="pass it undetached"):
        grpo_loss(lp, torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), entropy_coef=0.1,
                  entropy=torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------------------------------
# Properties


@st.composite
def rollouts(draw, one_token: bool = False):
    b = draw(st.integers(2, 6))
    t = 1 if one_token else draw(st.integers(1, 6))
    if one_token:
        mask = torch.ones(b, 1, dtype=torch.bool)
    else:
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    f = st.floats(-3.0, 0.0, width=32)
    lp, old, rollout = (torch.tensor(draw(st.lists(f, min_size=b * t, max_size=b * t))).reshape(b, t)
                        for _ in range(3))
    adv = torch.tensor(draw(st.lists(st.floats(-2.0, 2.0, width=32), min_size=b, max_size=b)))
    trunc = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    return lp, old, rollout, adv, mask, trunc, draw(st.integers(1, b - 1))


@settings(max_examples=60, deadline=None)
@given(rollouts(one_token=True), st.sampled_from(LOSS_TYPES), st.sampled_from(CORRECTIONS))
def test_gspo_equals_token_grpo_on_one_token_completions(batch, loss_type, correction):
    lp0, old, rollout, adv, mask, trunc, _ = batch
    out = []
    for level in LEVELS:
        lp = lp0.clone().requires_grad_(True)
        loss, _ = grpo_loss(lp, old, adv, mask, loss_type=loss_type, epsilon_high=4.0 if loss_type == "cispo" else 0.28,
                            max_completion_length=1, importance_sampling_level=level, rollout_log_probs=rollout,
                            rollout_correction=correction)
        loss.backward()
        out.append((loss.detach(), lp.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@settings(max_examples=80, deadline=None)
@given(rollouts(), st.sampled_from(["dr_grpo", "dapo", "cispo"]), st.sampled_from(LEVELS), st.sampled_from(CORRECTIONS),
       st.booleans())
def test_split_invariance(batch, loss_type, level, correction, mask_trunc):
    """dr_grpo / dapo / cispo: the micro-batch losses with the step's count sum to the full-batch loss (and so do the
    gradients), with GSPO's ratio and every rollout correction."""
    lp0, old, rollout, adv, mask, trunc, split = batch
    obj = GRPOObjective(loss_type=loss_type, epsilon_high=4.0 if loss_type == "cispo" else 0.28,
                        max_completion_length=7, mask_truncated_completions=mask_trunc,
                        importance_sampling_level=level, rollout_correction=correction)
    parts = [slice(0, split), slice(split, None)]
    count = sum(obj.local_count(mask[s], trunc[s], old[s], rollout[s]) for s in parts)
    lp_full = lp0.clone().requires_grad_(True)
    full, _ = obj(lp_full, old, adv, mask, step_count=count, truncated=trunc, rollout_log_probs=rollout)
    full.backward()
    lp = lp0.clone().requires_grad_(True)
    total = sum(obj(lp[s], old[s], adv[s], mask[s], step_count=count, truncated=trunc[s],
                    rollout_log_probs=rollout[s])[0] for s in parts)
    total.backward()
    assert math.isclose(total.item(), full.item(), rel_tol=1e-5, abs_tol=1e-5)
    torch.testing.assert_close(lp.grad, lp_full.grad, atol=1e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(rollouts(), st.sampled_from(LOSS_TYPES), st.sampled_from(LEVELS), st.sampled_from(CORRECTIONS))
def test_recomputed_old_log_probs_give_ratio_one_and_no_clipping(batch, loss_type, level, correction):
    """``old_log_probs: recompute`` hands the loss the same numbers as the first iteration's forward: ratio exactly 1,
    nothing clipped, for every loss type, level and correction (whose weights use the generation-time log-probs)."""
    lp0, _, rollout, adv, mask, trunc, _ = batch
    recomputed = lp0.clone()
    _, m = grpo_loss(lp0.clone().requires_grad_(True), recomputed, adv, mask, loss_type=loss_type,
                     epsilon_high=4.0 if loss_type == "cispo" else None, max_completion_length=7,
                     importance_sampling_level=level, rollout_log_probs=rollout, rollout_correction=correction)
    assert m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
    assert m["clip_ratio/region_mean"].item() == 0.0


def test_every_combination_is_accepted_by_the_objective():
    for loss_type, level, correction in itertools.product(LOSS_TYPES, LEVELS, CORRECTIONS):
        GRPOObjective(loss_type=loss_type, epsilon_high=5.0 if loss_type == "cispo" else None,
                      importance_sampling_level=level, rollout_correction=correction)
    with pytest.raises(ValueError, match="needs epsilon_high"):
        GRPOObjective(loss_type="cispo")
