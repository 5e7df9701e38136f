"""Per-step metrics of multi-turn episodes (GRPO with an ``environment``, issue 16 item 4).

:class:`~lit_llm.rollouts.EpisodeEngine` leaves one statistics dict per episode in :attr:`RolloutBatch.episodes
<lit_llm.rollouts.RolloutBatch.episodes>` (keys :data:`~lit_llm.rollouts.episodes.EPISODE_STAT_KEYS`).
:func:`episode_columns` turns them into a ``[N, K]`` float tensor that :class:`~lit_llm.lightning.grpo.GRPOModule`
gathers over the ranks (one ``all_gather``, like its reward columns), and :func:`episode_metrics` reduces the gathered
rows to the logged numbers:

=======================================  ===========================================================================
metric                                   meaning (over every rank's episodes of the step)
=======================================  ===========================================================================
``train/episodes/turns_mean``, ``_max``  model turns per episode
``train/episodes/tool_calls_mean``       tool calls per episode (``EnvStep.info["tool_calls"]`` summed)
``train/episodes/tool_call_rate``        fraction of episodes with at least one tool call
``train/episodes/tool_success_rate``     ``1 - tool_errors / tool_calls`` (logged only when some call was made)
``train/episodes/truncated``             fraction of episodes the engine ended (a limit, not the environment)
``train/episodes/truncated/<reason>``    fraction ended for each engine reason
                                         (:data:`~lit_llm.rollouts.episodes.ENGINE_REASONS`: ``max_turns``,
                                         ``max_episode_tokens``, ``max_new_tokens``, ``max_context``,
                                         ``env_timeout``, ``aborted``)
``train/episodes/sampled_tokens_mean``   sampled (trained) ids per episode
``train/episodes/env_tokens_mean``       environment ids per episode (attended to, never trained)
``train/reward_by_turns/<k>``            mean total reward of the episodes with ``k`` turns (for each ``k`` seen)
=======================================  ===========================================================================

Times (:func:`episode_times`, this rank's episodes, seconds): ``time/tools`` (tool calls) and ``time/env``
(``env.step``, tools included), each summed over the episodes, and ``time/episode_generation`` (the mean time an
episode waited for its model turns, batcher queueing included). Episodes run concurrently, so the sums may exceed the
rollout's wall-clock ``time/generation``; ``time/training`` is the optimizer step's.

Greedy evaluation (:class:`~lit_llm.lightning.grpo_eval.GreedyEvaluation`) logs :data:`EPISODE_EVAL_METRICS`.

Sample tables of episodes (:func:`episode_sample_columns`, :func:`episode_sample_row`): the training table
(``rollout_samples.csv``, wandb ``train/samples``) and the evaluation table (``eval_samples.csv``, ``eval/samples``)
share their column names for the same things::

    step, sample_id, prompt, completion, <lead>, env_reward, <reward functions>, turns, tool_calls, tool_errors, reason

``prompt`` is the episode's first render (system message with the tools' description, the question, the generation
prompt), ``completion`` everything after it (every turn and environment reply), both decoded with special tokens
kept so the turns show; ``<lead>`` is ``reward, advantage`` in training and ``reference`` (what the episode is scored
against) in evaluation; ``env_reward`` is the environment's reward (the reward named ``"env"``, before
``env_reward_weight``), then one column per reward function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_llm.rollouts.episodes import ENGINE_REASONS

__all__ = ["EPISODE_COLUMNS", "EPISODE_EVAL_METRICS", "EPISODE_SAMPLE_STATS", "episode_columns", "episode_metrics",
           "episode_sample_columns", "episode_sample_row", "episode_sample_table", "episode_times"]

#: Numeric per-episode columns gathered over ranks (then one indicator column per engine reason).
EPISODE_COLUMNS = ("turns", "tool_calls", "tool_errors", "truncated", "sampled_tokens", "env_tokens")

#: ``eval/<name>`` metrics of greedy episodes: the environment's reward (the calculator's accuracy), the fraction
#: of episodes with a tool call, the mean number of model turns.
EPISODE_EVAL_METRICS = ("env_reward", "tool_call_rate", "turns")

#: Per-episode statistics that end every row of an episode sample table.
EPISODE_SAMPLE_STATS = ("turns", "tool_calls", "tool_errors", "reason")


def episode_columns(episodes: Sequence[Mapping[str, Any]]) -> Tensor:
    """``[N, len(EPISODE_COLUMNS) + len(ENGINE_REASONS)]`` float32: each episode's :data:`EPISODE_COLUMNS` (booleans
    as 0/1), then a 0/1 indicator per engine reason (1 where the engine truncated the episode for that reason).

    Raises:
        KeyError: an episode dict without one of the keys (not an :class:`~lit_llm.rollouts.EpisodeEngine`'s).
    """
    rows = [[float(e[k]) for k in EPISODE_COLUMNS]
            + [float(bool(e["truncated"]) and e["reason"] == r) for r in ENGINE_REASONS] for e in episodes]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(EPISODE_COLUMNS) + len(ENGINE_REASONS))


def episode_metrics(columns: Tensor, reward: Tensor) -> dict[str, Tensor]:
    """The step's episode metrics (see the module docstring) from gathered :func:`episode_columns` rows and the
    episodes' total rewards.

    Args:
        columns: ``[N, K]`` float rows of :func:`episode_columns` (every rank's).
        reward: ``[N]`` total reward of the same episodes, in the same order.

    Returns:
        ``{metric name: 0-d float tensor}``.
    """
    c = {k: columns[:, i] for i, k in enumerate(EPISODE_COLUMNS)}
    turns, calls = c["turns"], c["tool_calls"]
    out = {"train/episodes/turns_mean": turns.mean(), "train/episodes/turns_max": turns.max(),
           "train/episodes/tool_calls_mean": calls.mean(), "train/episodes/tool_call_rate": (calls > 0).float().mean(),
           "train/episodes/truncated": c["truncated"].mean(),
           "train/episodes/sampled_tokens_mean": c["sampled_tokens"].mean(),
           "train/episodes/env_tokens_mean": c["env_tokens"].mean()}
    total_calls = calls.sum()
    if total_calls > 0:
        out["train/episodes/tool_success_rate"] = 1.0 - c["tool_errors"].sum() / total_calls
    for j, reason in enumerate(ENGINE_REASONS):
        out[f"train/episodes/truncated/{reason}"] = columns[:, len(EPISODE_COLUMNS) + j].mean()
    reward = reward.to(columns.device).float()
    for k in sorted({int(t) for t in turns.tolist()}):
        out[f"train/reward_by_turns/{k}"] = reward[turns == k].mean()
    return out


def episode_times(episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``time/tools``, ``time/env`` (seconds summed over ``episodes``) and ``time/episode_generation`` (mean seconds
    per episode) of this rank's episodes."""
    n = max(len(episodes), 1)
    return {"time/tools": float(sum(e["tool_time"] for e in episodes)),
            "time/env": float(sum(e["env_time"] for e in episodes)),
            "time/episode_generation": float(sum(e["generation_time"] for e in episodes)) / n}


def episode_sample_columns(lead: Sequence[str], reward_names: Sequence[str]) -> list[str]:
    """The header of an episode sample table (see the module docstring): ``step, sample_id, prompt, completion,
    *lead, env_reward, *reward_names,`` then :data:`EPISODE_SAMPLE_STATS`."""
    return ["step", "sample_id", "prompt", "completion", *lead, "env_reward", *reward_names, *EPISODE_SAMPLE_STATS]


def episode_sample_row(step: int, sample_id: Any, stats: Mapping[str, Any], lead: Sequence[Any],
                       rewards: Sequence[float]) -> list[Any]:
    """One row of :func:`episode_sample_columns`, from an episode's statistics dict
    (:meth:`~lit_llm.rollouts.Trajectory.stats`: ``prompt``, ``text``, ``env_reward``, ``turns``, ...); rewards
    rounded to 4 decimals."""
    return [step, sample_id, stats["prompt"], stats["text"], *lead, round(float(stats["env_reward"]), 4),
            *[round(float(r), 4) for r in rewards], *[stats[k] for k in EPISODE_SAMPLE_STATS]]


def episode_sample_table(step: int, rollout: Any, k: int) -> tuple[list[str], list[list[Any]]]:
    """The training sample table of the first ``k`` episodes of a rollout of episodes (a
    :class:`~lit_llm.rollouts.RolloutBatch` with ``episodes``): lead columns ``reward`` (the total) and
    ``advantage``, then ``env_reward`` and the other reward functions.

    Returns:
        ``(columns, rows)``.
    """
    names = [n for n in rollout.rewards.keys() if n != "env"]
    rows = [episode_sample_row(step, rollout.sample_id[i], rollout.episodes[i],
                               [round(float(rollout.reward[i]), 4), round(float(rollout.advantage[i]), 4)],
                               [rollout.rewards[n][i] for n in names]) for i in range(k)]
    return episode_sample_columns(["reward", "advantage"], names), rows
