"""GRPO-family advantages: the group baseline (GRPO, RLOO, REINFORCE++) and the ``scale_rewards`` divisor.

Formulas follow DeepSeekMath (Shao et al. 2024, arXiv:2402.03300) as implemented by TRL's ``GRPOTrainer``
(``_generate_and_score_completions``), the RLOO baseline (Ahmadian et al. 2024, arXiv:2402.14740) and REINFORCE++
(Hu 2025, arXiv:2501.03262). The group-size rule (:func:`check_num_generations`) is defined here once and called by
every layer that takes ``num_generations`` (rollout settings, engines, dynamic sampling).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "ScaleRewards", "check_advantage_settings",
           "check_num_generations", "compute_advantages"]

ScaleRewards = Literal["group", "batch", "none"]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_plus_plus"]
ADVANTAGE_ESTIMATORS = get_args(AdvantageEstimator)


def check_num_generations(num_generations: object) -> None:
    """The group-size rule: ``num_generations`` is an ``int >= 2`` (a group needs two completions to compare).

    Raises:
        ValueError: ``"num_generations must be an integer >= 2, got <value>."`` (callers prefix their name).
    """
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an integer >= 2, got {num_generations!r}.")


def check_advantage_settings(num_generations: int, scale_rewards: str, advantage_estimator: str) -> None:
    """The settings checks of :func:`compute_advantages` (callable before any reward exists).

    Raises:
        ValueError: ``num_generations`` not an int >= 2; unknown ``scale_rewards`` / ``advantage_estimator``;
            ``reinforce_plus_plus`` with ``scale_rewards="group"``.
    """
    check_num_generations(num_generations)
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; choose 'group', 'batch' or 'none'.")
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"Unknown advantage_estimator {advantage_estimator!r}; choose 'grpo', 'rloo' or "
                         f"'reinforce_plus_plus'.")
    if advantage_estimator == "reinforce_plus_plus" and scale_rewards == "group":
        raise ValueError("advantage_estimator='reinforce_plus_plus' normalises over the batch (its definition); set "
                         "scale_rewards to 'batch' (REINFORCE++) or 'none' (group baseline only).")


def compute_advantages(
    rewards: Tensor, num_generations: int, *, scale_rewards: ScaleRewards = "group", eps: float = 1e-4,
    advantage_estimator: AdvantageEstimator = "grpo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-completion advantages: a baseline from the prompt's group, then the ``scale_rewards`` divisor.

    Rows are grouped contiguously: rows ``[k*G, (k+1)*G)`` are the ``G = num_generations`` completions of prompt
    ``k``. ``std`` is the unbiased (n-1) standard deviation, as ``torch.std`` in TRL's
    ``_generate_and_score_completions``; ``eps = 1e-4`` is TRL's constant.

    Estimators (the baseline) and how each combines with ``scale_rewards`` (the divisor):

    * ``"grpo"`` (DeepSeekMath): ``c_i = r_i - mean(group)``; then ``"group"``: ``c_i / (std(group) + eps)`` (TRL
      default), ``"batch"``: ``c_i / (std(all rewards) + eps)`` (TRL ``scale_rewards="batch"``), ``"none"``: ``c_i``
      (Dr. GRPO).
    * ``"rloo"`` (leave-one-out, Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740): ``c_i = r_i -
      mean_{j != i} r_j = G / (G - 1) * (r_i - mean(group))``, then the same three divisors as ``"grpo"`` (so with
      ``"group"`` it is ``G / (G - 1)`` times GRPO's advantage; ``"none"`` is TRL's ``RLOOTrainer`` without
      ``normalize_advantages``).
    * ``"reinforce_plus_plus"`` (REINFORCE++ with the group baseline, Hu 2025, arXiv:2501.03262, OpenRLHF's
      ``reinforce_baseline``): ``c_i = r_i - mean(group)``, then batch normalisation of those ``c``: ``"batch"``:
      ``(c_i - mean(c)) / (std(c) + eps)`` over every completion of the batch (one row = one completion; verl whitens
      per token instead); ``"none"``: ``c_i`` only. ``"group"`` is an error: the estimator's divisor is the batch's.

    A group whose rewards are all equal (std ``isclose`` to 0) gets advantage exactly 0 under every estimator and is
    counted in ``frac_reward_zero_std`` (computed from the group std in every mode; TRL uses the batch std in
    ``"batch"`` mode).

    Args:
        rewards: ``[N]`` float, total reward per completion, ``N = num_prompts * num_generations``.
        num_generations: group size ``G`` (>= 2).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        eps: added to the std before dividing.
        advantage_estimator: ``"grpo"``, ``"rloo"`` or ``"reinforce_plus_plus"``.

    Returns:
        ``(advantages, stats)``: ``advantages`` ``[N]`` float32 (no grad). ``stats`` holds 0-d float32 tensors
        ``reward_mean``, ``reward_std`` (unbiased std of the batch), ``reward_group_std_mean`` (mean group std, TRL's
        ``reward_std``) and ``frac_reward_zero_std`` (fraction of groups with zero std).

    Raises:
        ValueError: ``num_generations < 2``; ``N`` not divisible by ``num_generations``; ``rewards`` not 1-D or
            holding NaN/inf; unknown ``scale_rewards`` or ``advantage_estimator``; ``reinforce_plus_plus`` with
            ``scale_rewards="group"``; negative ``eps``.
    """
    check_advantage_settings(num_generations, scale_rewards, advantage_estimator)
    if not isinstance(rewards, Tensor) or rewards.ndim != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor [N], got {shape}.")
    if rewards.numel() == 0 or rewards.numel() % num_generations:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a positive multiple of num_generations="
                         f"{num_generations}; the batch must hold num_generations completions per prompt.")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}.")
    r = rewards.detach().float()
    bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards holds non-finite values at sample indices {bad}; a reward function returned "
                         f"NaN/inf (RewardFunctions names the function).")
    g = num_generations
    groups = r.view(-1, g)
    group_mean = groups.mean(dim=1, keepdim=True)
    group_std = groups.std(dim=1, keepdim=True)
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    if advantage_estimator == "rloo":  # the mean of the other G - 1 rewards
        adv = groups - (groups.sum(dim=1, keepdim=True) - groups) / (g - 1)
    else:
        adv = groups - group_mean
    if advantage_estimator == "reinforce_plus_plus":
        if scale_rewards == "batch":
            adv = (adv - adv.mean()) / (adv.std() + eps)
    elif scale_rewards == "group":
        adv = adv / (group_std + eps)
    elif scale_rewards == "batch":
        adv = adv / (r.std() + eps)
    adv = torch.where(zero_std, torch.zeros_like(adv), adv).reshape(-1)
    stats = {
        "reward_mean": r.mean(),
        "reward_std": r.std(),
        "reward_group_std_mean": group_std.mean(),
        "frac_reward_zero_std": zero_std.float().mean(),
    }
    return adv, stats
