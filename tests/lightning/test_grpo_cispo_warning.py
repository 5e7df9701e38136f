"""``loss_type="cispo"`` with ``epsilon_high <= 1`` warns at construction (review item 4): CISPO's ``epsilon_high`` is
an absolute cap on the importance-sampling weight (TRL's semantics), so the DAPO clip-higher value 0.28 would cap
every token's weight at 0.28."""

from __future__ import annotations

import warnings

import pytest

from lit_llm.lightning.grpo import GRPOModule

REWARDS = ["strict_arithmetic_reward"]


@pytest.mark.parametrize("epsilon_high", [0.28, 1.0])
def test_cispo_with_a_clip_width_warns(epsilon_high):
    with pytest.warns(UserWarning, match=rf"loss_type='cispo' with epsilon_high={epsilon_high}: CISPO's epsilon_high "
                                         rf"is an absolute cap on the importance-sampling weight .* every token's "
                                         rf"weight is capped at {epsilon_high} .* e\.g\. 5\.0 \(TRL's recommended"):
        GRPOModule("tiny", reward_funcs=REWARDS, loss_type="cispo", epsilon_high=epsilon_high)


@pytest.mark.parametrize(("loss_type", "epsilon_high"), [("cispo", 5.0), ("cispo", 1.5), ("dapo", 0.28)])
def test_no_warning_for_a_weight_cap_or_other_losses(loss_type, epsilon_high):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOModule("tiny", reward_funcs=REWARDS, loss_type=loss_type, epsilon_high=epsilon_high)
    assert not [w for w in caught if "cispo" in str(w.message)]
