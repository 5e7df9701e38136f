"""GRPO's per-step metrics: what one training batch logs (see :mod:`lit_llm.lightning.grpo`'s docstring for the
names), gathered from the objective's per-micro-batch metrics (:class:`GRPOStepStats`) and the rollout
(:func:`rollout_metrics`), and the table of sampled completions (:func:`sample_table`).

Sums are kept per micro-batch (token-weighted) and divided once per batch; the ratio ranges are this rank's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lit_llm.lightning.episode_metrics import episode_columns, episode_metrics, episode_sample_table, episode_times
from lit_llm.rollouts import RolloutBatch

__all__ = ["REQUIRED_METRICS", "GRPOStepStats", "rollout_metrics", "sample_table"]

#: The keys of :func:`~lit_llm.objectives.grpo_loss`'s metrics the step statistics read (a user's objective keeps
#: them by returning ``super().__call__(...)``'s metrics with its loss).
REQUIRED_METRICS = ("loss", "num_tokens", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                    "ratio_mean", "ratio_min", "ratio_max", "entropy", "mismatch/kl", "mismatch/num_tokens",
                    "mismatch/ratio_min", "mismatch/ratio_max")


class GRPOStepStats:
    """The statistics of one training batch's optimizer steps (``num_iterations`` of them), filled micro-batch by
    micro-batch (:meth:`add`) and step by step (:meth:`end_step`)."""

    def __init__(self) -> None:
        self.reset(1)

    def reset(self, num_micro_batches: int) -> None:
        """Start a training batch of ``num_micro_batches`` micro-batches per optimizer step."""
        self.num_micro_batches = num_micro_batches
        self.iterations: list[dict[str, Tensor]] = []  # each optimizer step's sums over micro-batches and ranks
        self.ratio_range = (float("inf"), float("-inf"))  # this rank's ratio min / max over the batch's steps
        self.first_ranges: dict[str, tuple[float, float]] = {}  # first iteration: GRPO ratio and mismatch ratio
        self.iteration = 0
        self.recompute_time = 0.0

    def add(self, m: dict[str, Tensor], real_tokens: Tensor) -> dict[str, Tensor]:
        """The detached sums one micro-batch adds to its step's totals, from the objective's metrics ``m``
        (:func:`~lit_llm.objectives.grpo_loss`'s keys) and its ``real_tokens`` (prompt + completion tokens); this
        rank's ratio ranges are updated on the way.

        Raises:
            ValueError: ``m`` lacks a key of :data:`REQUIRED_METRICS` (a user's objective that returned its own
                metrics), naming them and the fix.
        """
        missing = [k for k in REQUIRED_METRICS if k not in m]
        if missing:
            raise ValueError(f"GRPOModule: the objective's metrics lack {missing} (the step's statistics read "
                             f"grpo_loss's metrics); return super().__call__(...)'s metrics with your loss, or add "
                             f"these keys.")
        n, n0 = m["num_tokens"], m["mismatch/num_tokens"]
        stats = {"loss": m["loss"], "num_tokens": n, "num_real_tokens": real_tokens,
                 "clip_low": m["clip_ratio/low_mean"] * n, "clip_high": m["clip_ratio/high_mean"] * n,
                 "clip_region": m["clip_ratio/region_mean"] * n, "ratio_sum": m["ratio_mean"] * n,
                 "entropy_sum": m["entropy"] * n, "mismatch_kl_sum": m["mismatch/kl"] * n0, "mismatch_tokens": n0}
        if "rollout_correction/weight_mean" in m:
            stats["corrected_sum"] = m["rollout_correction/corrected_fraction"] * n0
            stats["weight_sum"] = m["rollout_correction/weight_mean"] * n
        # the ranges stay on the device (no host read per micro-batch); logged as tensors
        self.ratio_range = _widen(self.ratio_range, m["ratio_min"], m["ratio_max"])
        if self.iteration == 0:
            for key, prefix in (("ratio", ""), ("mismatch", "mismatch/")):
                lo, hi = self.first_ranges.get(key, (float("inf"), float("-inf")))
                wide = _widen((lo, hi), m[f"{prefix}ratio_min"], m[f"{prefix}ratio_max"])
                self.first_ranges[key] = (torch.where(n0 > 0, wide[0], lo), torch.where(n0 > 0, wide[1], hi))
        if "kl" in m:
            stats["kl_sum"] = m["kl"] * n
        return stats

    def end_step(self, summed: dict[str, Tensor]) -> None:
        """Keep one optimizer step's sums (all micro-batches, all ranks)."""
        self.iterations.append(summed)

    def metrics(self, train_time: float, trained_tokens: Tensor, recompute: bool) -> dict[str, Tensor | float]:
        """The loss-side metrics of the batch (``{}`` when no step ran)."""
        it = self.iterations
        if not it:
            return {}
        n = sum(s["num_tokens"] for s in it).clamp(min=1)
        log: dict[str, Tensor | float] = {
            "train/loss": it[-1]["loss"], "train/grad_norm": it[-1]["grad_norm"], "train/lr": it[-1]["lr"],
            "train/clip_ratio/low_mean": sum(s["clip_low"] for s in it) / n,
            "train/clip_ratio/high_mean": sum(s["clip_high"] for s in it) / n,
            "train/clip_ratio/region_mean": sum(s["clip_region"] for s in it) / n,
            "train/ratio_mean": sum(s["ratio_sum"] for s in it) / n,
            "train/ratio_min": self.ratio_range[0], "train/ratio_max": self.ratio_range[1],
            "train/entropy": sum(s["entropy_sum"] for s in it) / n,
            "train/tokens": trained_tokens.float(),
            "train/step_tokens": it[-1]["num_tokens"],
        }
        if "kl_sum" in it[0]:
            log["train/kl"] = sum(s["kl_sum"] for s in it) / n
        first, n_first = it[0], it[0]["num_tokens"].clamp(min=1)
        n_mismatch = first["mismatch_tokens"].clamp(min=1)
        log["train/mismatch/kl"] = first["mismatch_kl_sum"] / n_mismatch
        log["train/first_iteration/clip_ratio"] = first["clip_region"] / n_first
        for key, name in (("ratio", "first_iteration/ratio"), ("mismatch", "mismatch/ratio")):
            lo, hi = self.first_ranges.get(key, (1.0, 1.0))
            if isinstance(lo, Tensor):  # no token was counted: the empty range logs 1.0
                lo, hi = torch.where(lo <= hi, lo, 1.0), torch.where(lo <= hi, hi, 1.0)
            log[f"train/{name}_min"], log[f"train/{name}_max"] = lo, hi
        if "corrected_sum" in first:
            log["train/rollout_correction/corrected_fraction"] = first["corrected_sum"] / n_mismatch
            log["train/rollout_correction/weight_mean"] = first["weight_sum"] / n_first
        if recompute:
            log["time/recompute"] = self.recompute_time
        if train_time > 0:
            log["train/tokens_per_sec"] = sum(s["num_real_tokens"] for s in it) / train_time
        return log


def _widen(bounds: tuple[Tensor | float, Tensor | float], low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
    """``(min(bounds[0], low), max(bounds[1], high))`` as 0-d fp32 tensors on ``low``'s device (no host read); a
    float bound is the empty range's ``inf`` / ``-inf``."""
    low, high = low.detach().float().reshape(()), high.detach().float().reshape(())
    return (low if isinstance(bounds[0], float) else torch.minimum(bounds[0], low),
            high if isinstance(bounds[1], float) else torch.maximum(bounds[1], high))


def rollout_metrics(module: Any, rollout: RolloutBatch, *, staleness: int, wait_time: float, train_time: float,
                    step_time: float) -> dict[str, Tensor | float]:
    """The rollout-side metrics of a training batch over every rank's rows (one ``all_gather``, called by every rank
    in the same order: the ranks hold different prompts, so rank 0's rows alone would misreport rewards and lengths
    under DDP); times, throughput and dynamic sampling's rounds are this rank's. With a ``reward_timeout``,
    ``train/rewards/<name>/timeouts``: the reward-function calls abandoned since the previous step's log, all ranks
    (:meth:`~lit_llm.rewards.RewardFunctions.take_timeouts`; an asynchronous producer's calls included).
    ``train/reward`` / ``train/reward_std`` are over the rows at least one reward function scored: a row every function
    left ``None`` (all its calls timed out) totals 0 in training (TRL's rule) but is not logged as a reward of 0; when
    no row was scored they are NaN (and the timeouts say why), as ``train/rewards/<name>/mean`` / ``std`` are for a
    function that scored no row.

    Args:
        module: the :class:`~lit_llm.lightning.grpo.GRPOModule` (its trainer, device, ``all_gather``, counters and
            version switch are read).
        rollout: the trained batch.
        staleness, wait_time, train_time, step_time: the step's staleness (steps) and times (s).
    """
    names = list(rollout.rewards.keys())
    reward = rollout.reward.float()
    rewards = getattr(module, "rewards", None)  # calls timed out since the last step's log, this rank's in row 0
    timeouts = rewards.take_timeouts() if rewards is not None and rewards.timeout is not None else {}
    counts = [torch.zeros_like(reward) for _ in timeouts]
    for col, c in zip(counts, timeouts.values()):
        col[:1] = float(c)
    cols = torch.stack([reward, rollout.completion_lengths.float(), rollout.truncated.float(),
                        *[rollout.rewards[n].float() for n in names], *counts,
                        torch.full_like(reward, float(rollout.frac_reward_zero_std))], 1).to(module.device)
    if module.trainer.world_size > 1:
        cols = module.all_gather(cols).reshape(-1, cols.shape[1])
    rewards, lengths, truncated = cols[:, 0], cols[:, 1], cols[:, 2]
    scored = rewards[~cols[:, 3:3 + len(names)].isnan().all(1)] if names else rewards  # a row no function scored
    gen_time = float(rollout.generation_time)  # (every call timed out) totals 0 but is not a reward of 0: left out
    log: dict[str, Tensor | float] = {
        "train/reward": scored.mean() if scored.numel() else math.nan,
        "train/reward_std": scored.std() if scored.numel() > 1 else 0.0 if scored.numel() else math.nan,
        "train/frac_reward_zero_std": cols[:, -1].mean(),  # every rank holds the same number of groups
        "train/completions/mean_length": lengths.mean(), "train/completions/min_length": lengths.min(),
        "train/completions/max_length": lengths.max(),
        "train/completions/clipped_ratio": truncated.mean(),
        "train/staleness": float(staleness), "train/dropped_rollouts": module.dropped_rollouts.float(),
        "time/generation": gen_time, "time/rollout_wait": wait_time, "time/training": train_time,
        "time/step": step_time,
    }
    versions = module.versions
    if versions.dynamic_sampling:
        log["train/sampling_rounds"] = float(versions.last_sampling_rounds)
        log["train/sampling_cap_reached"] = float(versions.sampling_cap.count)
    if gen_time > 0:  # this rank's generation throughput (dynamic sampling: every round's tokens, not the kept)
        generated = (versions.last_generated_tokens if versions.dynamic_sampling
                     else rollout.completion_lengths.float().sum())
        log["rollout/tokens_per_sec"] = generated / gen_time
    for j, name in enumerate(names):
        values = cols[:, 3 + j]
        log[f"train/rewards/{name}/mean"] = values.nanmean()
        finite = values[~values.isnan()]
        log[f"train/rewards/{name}/std"] = finite.std() if finite.numel() > 1 else 0.0 if finite.numel() else math.nan
    for j, name in enumerate(timeouts):  # summed over ranks
        log[f"train/rewards/{name}/timeouts"] = cols[:, 3 + len(names) + j].sum()
    if rollout.episodes is not None:  # multi-turn episodes: their own statistics (same rank order as cols)
        episodes = episode_columns(rollout.episodes).to(module.device)
        if module.trainer.world_size > 1:
            episodes = module.all_gather(episodes).reshape(-1, episodes.shape[1])
        log.update(episode_metrics(episodes, rewards))
        log.update(episode_times(rollout.episodes))
    return log


def sample_table(rollout: RolloutBatch, step: int, k: int) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of the first ``k`` sampled completions of a rollout: step, sample id, completion, reward,
    advantage and each reward function's value; whole episodes in the evaluation table's columns for a multi-turn
    rollout (:func:`~lit_llm.lightning.episode_metrics.episode_sample_table`)."""
    if rollout.episodes is not None:
        return episode_sample_table(step, rollout, k)
    names = list(rollout.rewards.keys())
    columns = ["step", "sample_id", "completion", "reward", "advantage", *names]
    rows = [[step, rollout.sample_id[i], rollout.completion[i],
             round(float(rollout.reward[i]), 4), round(float(rollout.advantage[i]), 4),
             *[round(float(rollout.rewards[n][i]), 4) for n in names]] for i in range(k)]
    return columns, rows
