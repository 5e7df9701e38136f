"""GRPOModule with the issue-15 objectives: ``old_log_probs: recompute`` (ratio exactly 1 at the first on-policy
iteration, fp32 and bf16-mixed), the sampler/trainer mismatch metrics, the rollout correction, GSPO / CISPO / the
advantage estimators / the entropy bonus wired through the module, and the option checks."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer
from test_grpo import Recorder, frac_reward  # tests/lightning/test_grpo.py (pytest puts its folder on sys.path)

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule

pytestmark = pytest.mark.usefixtures("one_thread")


def fit(steps: int, *, precision: str = "32-true", **module_kwargs) -> tuple[GRPOModule, list[dict[str, float]]]:
    torch.manual_seed(0)
    kw = dict(reward_funcs=[frac_reward], num_generations=4, max_new_tokens=4, micro_batch_size=4,
              log_samples_every=0, rollout_seed=5, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    kw.update(module_kwargs)
    module = GRPOModule("tiny", **kw)
    dm = GRPODataModule(batch_size=2, num_train=40, num_eval=0)
    rec = Recorder()
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[rec], precision=precision,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, dm)
    return module, rec.steps


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_recompute_gives_ratio_exactly_one_at_the_first_iteration(precision):
    _, steps = fit(2, precision=precision, old_log_probs="recompute", num_iterations=2)
    for s in steps:  # one batch = 2 optimizer steps (mu = 2): the first on-policy, the second not
        assert s["train/first_iteration/ratio_min"] == 1.0 and s["train/first_iteration/ratio_max"] == 1.0
        assert s["train/first_iteration/clip_ratio"] == 0.0
        assert s["time/recompute"] > 0
        assert s["train/mismatch/kl"] >= 0 and math.isfinite(s["train/mismatch/kl"])
        assert s["train/ratio_max"] - s["train/ratio_min"] > 1e-4  # the second iteration moved
        if precision == "32-true":  # fp32: generation and teacher forcing agree to the 1e-4 contract
            assert abs(s["train/mismatch/ratio_min"] - 1) < 1e-4 and abs(s["train/mismatch/ratio_max"] - 1) < 1e-4
            assert s["train/mismatch/kl"] < 1e-8


def test_rollout_old_log_probs_report_the_mismatch_as_the_first_ratio():
    """With ``old_log_probs: rollout`` the first iteration's GRPO ratio *is* trainer / sampler: the two ranges agree
    and stay within the fp32 contract."""
    _, steps = fit(2)
    for s in steps:
        assert s["train/first_iteration/ratio_min"] == pytest.approx(s["train/mismatch/ratio_min"], abs=1e-6)
        assert s["train/first_iteration/ratio_max"] == pytest.approx(s["train/mismatch/ratio_max"], abs=1e-6)
        assert abs(s["train/first_iteration/ratio_min"] - 1) < 1e-4 and s["train/first_iteration/clip_ratio"] == 0
        assert "time/recompute" not in s and "train/rollout_correction/weight_mean" not in s


@pytest.mark.parametrize("correction", ["token_truncate", "sequence_mask"])
def test_rollout_correction_logs_its_weights(correction):
    _, steps = fit(2, old_log_probs="recompute", rollout_correction=correction)
    for s in steps:
        assert s["train/rollout_correction/corrected_fraction"] == 0.0  # fp32: weights ~1, inside [1/2, 2]
        assert s["train/rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert s["train/first_iteration/ratio_min"] == 1.0 == s["train/first_iteration/ratio_max"]


def test_first_step_losses_of_the_objectives():
    """Same seed, same rollouts at step 1 (recomputed old log-probs, ratio exactly 1): GSPO's loss equals token-level
    GRPO's; the entropy bonus subtracts ``entropy_coef * entropy``; CISPO's loss is ``-mean(A * logp)``-shaped and
    differs; RLOO's advantages are ``G / (G - 1)`` times GRPO's with ``scale_rewards: none``."""
    base = dict(old_log_probs="recompute")
    _, tok = fit(1, **base)
    _, seq = fit(1, importance_sampling_level="sequence", **base)
    assert seq[0]["train/loss"] == pytest.approx(tok[0]["train/loss"], abs=1e-6)
    _, ent = fit(1, entropy_coef=0.1, **base)
    assert ent[0]["train/loss"] == pytest.approx(tok[0]["train/loss"] - 0.1 * tok[0]["train/entropy"], abs=1e-5)
    _, cispo = fit(1, loss_type="cispo", epsilon_high=5.0, **base)
    assert math.isfinite(cispo[0]["train/loss"]) and cispo[0]["train/clip_ratio/high_mean"] == 0.0
    _, none = fit(1, scale_rewards="none", **base)
    _, rloo = fit(1, scale_rewards="none", advantage_estimator="rloo", **base)
    assert rloo[0]["train/loss"] == pytest.approx(none[0]["train/loss"] * 4 / 3, abs=1e-6)
    _, rpp = fit(1, scale_rewards="batch", advantage_estimator="reinforce_plus_plus", **base)
    assert math.isfinite(rpp[0]["train/loss"])


def test_engine_gets_the_advantage_estimator():
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=4, max_new_tokens=4, rollout_seed=2,
                        advantage_estimator="rloo", scale_rewards="none")
    assert module.engine.advantage_estimator == "rloo"
    rb = module.engine.rollout({"prompt": ["What is 1 + 1?", "Hello"]}, step=0)
    r = rb.reward.view(2, 4)
    expected = (r - (r.sum(1, keepdim=True) - r) / 3).reshape(-1)
    torch.testing.assert_close(rb.advantage, expected, atol=1e-6, rtol=0)
    assert torch.equal(rb.rollout_log_probs, rb.old_log_probs)


def test_with_old_log_probs_keeps_rollout_log_probs():
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=2, max_new_tokens=3, rollout_seed=2)
    rb = module.engine.rollout({"prompt": ["Hi"]}, step=0)
    new = rb.with_old_log_probs(torch.full_like(rb.old_log_probs, -7.0))
    assert (new.old_log_probs[rb.completion_mask] == -7).all() and (new.old_log_probs[~rb.completion_mask] == 0).all()
    assert torch.equal(new.rollout_log_probs, rb.rollout_log_probs) and torch.equal(rb.old_log_probs,
                                                                                      rb.rollout_log_probs)
    sub = new.select_rows([1])
    assert torch.equal(sub.rollout_log_probs[0], rb.rollout_log_probs[1, :sub.rollout_log_probs.shape[1]])
    with pytest.raises(ValueError, match="with_old_log_probs: expected shape"):
        rb.with_old_log_probs(torch.zeros(1, 1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rollout_correction": "token_truncate"}, "set old_log_probs: recompute"),
        ({"rollout_mode": "async", "old_log_probs": "recompute"}, "would hide the rollouts' staleness"),
        ({"old_log_probs": "generation"}, "old_log_probs must be 'rollout'"),
        ({"advantage_estimator": "reinforce_plus_plus"}, "GRPOModule: advantage_estimator='reinforce_plus_plus'"),
        ({"loss_type": "cispo"}, "needs epsilon_high"),
        ({"loss_type": "ppo"}, "GRPOModule: Unknown loss_type 'ppo'"),
    ],
)
def test_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=2, **kwargs)


def test_async_recompute_with_a_correction_is_accepted():
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=2, rollout_mode="async",
                        old_log_probs="recompute", rollout_correction="token_truncate")
    assert module.objective.rollout_correction == "token_truncate"
