"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476 section 3.2; verl's ``algorithm.filter_groups``): keep
the prompt groups whose rewards differ, refill the batch with the groups of extra prompt batches, and recompute the
advantages over the batch that is trained.

A group whose ``G`` rewards are all equal has advantage 0 under every estimator: it adds no gradient, yet it counts
in the step's token normaliser and shrinks the step. When most groups are such (a policy that answers every prompt
the same way, or none of a hard batch right), the step rests on the few informative groups. Dynamic sampling draws
further prompt batches for the same step until ``num_groups`` informative groups are found or the rounds run out.

Here the batch keeps its size: when the rounds run out first, the remaining slots are filled with zero-std groups
(first-drawn first), so every step trains ``num_groups`` groups (the same number of micro-batches on every rank,
which DDP needs). verl instead keeps sampling up to ``max_num_gen_batches`` and then raises. Such a step is counted and
warned about (:class:`SamplingCap`): with no informative group at all its policy-gradient loss is 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from lit_llm.objectives.advantages import check_num_generations, compute_advantages
from lit_llm.rollouts.batch import RolloutBatch

__all__ = ["SamplingCap", "informative_groups", "select_groups"]


def informative_groups(reward: Tensor, num_generations: int) -> Tensor:
    """``[N // G]`` bool: True where the group's rewards are not all equal (their std is not ``isclose`` to 0, the
    test :func:`~lit_llm.objectives.compute_advantages` counts in ``frac_reward_zero_std``). Rows ``[k*G, (k+1)*G)``
    are group ``k``.

    Raises:
        ValueError: ``reward`` not 1-D or not a multiple of ``num_generations`` (>= 2) long.
    """
    check_num_generations(num_generations)
    if reward.ndim != 1 or reward.numel() % num_generations:
        raise ValueError(f"informative_groups: reward must be 1-D with a multiple of num_generations={num_generations} "
                         f"(>= 2) entries, got shape {tuple(reward.shape)}.")
    std = reward.detach().float().view(-1, num_generations).std(dim=1)
    return ~torch.isclose(std, torch.zeros_like(std))


def select_groups(rollouts: Sequence[RolloutBatch], num_groups: int, num_generations: int, *,
                  scale_rewards: str, advantage_estimator: str = "grpo") -> RolloutBatch:
    """The batch of ``num_groups`` groups trained after dynamic sampling.

    Informative groups first, in the order drawn (``rollouts[0]``'s first), then, if fewer than ``num_groups`` were
    found, zero-std groups in the order drawn. The advantages are recomputed over the selected rows
    (:func:`~lit_llm.objectives.compute_advantages` with ``scale_rewards`` / ``advantage_estimator``, so a
    ``"batch"`` std is the trained batch's); ``group`` is renumbered ``0 .. num_groups - 1``;
    ``frac_reward_zero_std`` is the fraction of zero-std groups among **all** groups drawn (the policy's own state,
    what collapse checks read; the trained batch has fewer), ``generation_time`` and ``reward_time`` the sums.

    Args:
        rollouts: the step's rollouts (``G`` contiguous rows per group, as :class:`RolloutEngine` builds them).
        num_groups: groups to keep (the step's batch size in prompts).
        num_generations: ``G``.

    Raises:
        ValueError: no rollout, or fewer than ``num_groups`` groups drawn in all.
    """
    if not rollouts:
        raise ValueError("select_groups: needs at least one rollout.")
    g = num_generations
    flags = [informative_groups(r.reward, g) for r in rollouts]
    drawn = sum(int(f.numel()) for f in flags)
    if drawn < num_groups:
        raise ValueError(f"select_groups: {drawn} groups drawn, fewer than the {num_groups} to keep.")
    picked: list[tuple[int, int]] = [(i, k) for i, f in enumerate(flags) for k in f.nonzero().flatten().tolist()]
    picked += [(i, k) for i, f in enumerate(flags) for k in (~f).nonzero().flatten().tolist()]
    first_row = [0]
    for r in rollouts:
        first_row.append(first_row[-1] + r.num_rows)
    rows = [first_row[i] + k * g + j for i, k in picked[:num_groups] for j in range(g)]
    out = RolloutBatch.cat(rollouts).select_rows(rows)
    advantage, _ = compute_advantages(out.reward, g, scale_rewards=scale_rewards,  # type: ignore[arg-type]
                                      advantage_estimator=advantage_estimator)  # type: ignore[arg-type]
    out.advantage = advantage
    out.group = torch.arange(num_groups, device=out.reward.device).repeat_interleave(g)
    out.frac_reward_zero_std = 1.0 - sum(int(f.sum()) for f in flags) / drawn
    return out  # generation_time / reward_time: cat's sums, kept by select_rows


class SamplingCap:
    """Counts the steps whose dynamic sampling stopped (``max_sampling_rounds`` reached, or the epoch's prompts used
    up) before the batch held ``num_groups`` informative groups, and warns (``UserWarning``) on the 1st, 10th, 100th,
    ... such step: the batch is then topped up with zero-std groups (advantage 0), and with no informative group at
    all the step's policy-gradient loss is 0 (only a KL or entropy term trains). :attr:`count` is logged as
    ``train/sampling_cap_reached`` (this rank's; the policy version switch keeps one).

    Attributes:
        count: such steps so far (this process; not restored on resume).
    """

    def __init__(self) -> None:
        self.count = 0

    def update(self, *, found: int, num_groups: int, rounds: int, max_rounds: int, step: int) -> bool:
        """Record one step's dynamic sampling; ``True`` when it stopped short of ``num_groups`` informative groups.

        Args:
            found: informative groups among every round's groups (this rank's).
            num_groups: groups trained per step (this rank's batch, in prompts).
            rounds: rollouts drawn for the step, its own included.
            max_rounds: ``max_sampling_rounds``.
            step: the optimizer step, named in the warning.
        """
        if found >= num_groups:
            return False
        self.count += 1
        if str(self.count).strip("0") == "1":  # 1, 10, 100, ...: a steady reminder, not one line per step
            why = (f"reached max_sampling_rounds={max_rounds}" if rounds >= max_rounds
                   else f"used up the epoch's prompts after {rounds} round(s)")
            what = ("so its policy-gradient loss is 0 (all advantages 0)" if found == 0 else
                    f"the other {num_groups - found} have advantage 0")
            warnings.warn(f"dynamic sampling {why} at step {step} with {found} of {num_groups} "
                          f"groups informative (rewards not all equal): {what}. {self.count} such step(s) so far, "
                          f"logged as train/sampling_cap_reached. Fix: raise --model.init_args.max_sampling_rounds, "
                          f"give partial credit in the rewards, or use easier prompts.", UserWarning, stacklevel=2)
        return True
