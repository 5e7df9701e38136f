"""Greedy evaluation of a GRPO policy on held-out prompts: answers from the greedy version of the policy's generate
version (:meth:`~lit_llm.lightning.versions.PolicyVersionSwitch.greedy`), scored by the evaluation reward functions.

With an ``environment`` (multi-turn GRPO) each held-out row is one **greedy episode**: the training
:class:`~lit_llm.rollouts.EpisodeEngine`'s settings over the greedy version (``eval_max_new_tokens`` per turn), the
episodes of a batch run concurrently through the batcher (:meth:`GreedyEvaluation.greedy_episodes`). Logged:
``eval/env_reward`` (the environment's reward: the calculator's exact-answer accuracy), ``eval/tool_call_rate``
(episodes with at least one tool call), ``eval/turns`` (model turns per episode) and ``eval/<fn>`` of the evaluation
reward functions over whole episodes (with the ``tools`` column, as in training); ``eval_samples.csv`` shows whole
episodes with the training table's columns (:func:`~lit_llm.lightning.episode_metrics.episode_sample_columns`: the
``prompt``, the ``completion`` after it, special tokens kept so the turns show, ``reference``, ``env_reward``, the
reward functions, ``turns``, ``tool_calls``, ``tool_errors``, ``reason``).

:class:`GreedyEvaluation` is mixed into :class:`~lit_llm.lightning.grpo.GRPOModule`: ``trainer.val_check_interval``
runs it every N steps; each ``eval_reward_funcs`` function's mean is logged as ``eval/<fn>`` (torchmetrics, synced
over ranks); with ``trainer.num_sanity_val_steps: -1`` the full evaluation also runs before training and is logged at
step 0 (the "before" number). The first completions go to ``eval_samples.csv`` (and a wandb table). Metrics are
logged at :attr:`eval_step` (``global_step``; the checkpoint's step in ``validate``); the line reporting them is the
:class:`~lit_llm.lightning.progress.StepProgressBar`'s, or ``[step N] greedy eval: ...`` for the sanity check (its
values go to the loggers directly, not through the bar) and when no such bar is attached.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lit_llm.data.prompts import tokenize_prompts
from lit_llm.lightning.episode_metrics import episode_sample_columns, episode_sample_row
from lit_llm.lightning.progress import StepProgressBar
from lit_llm.lightning.tables import append_csv, log_table
from lit_llm.rollouts import EpisodeEngine, Trajectory
from lit_llm.rollouts.engine import read_prompt_batch
from lit_llm.rollouts.envs import tool_schemas

__all__ = ["GreedyEvaluation"]


class GreedyEvaluation:
    """Validation hooks of a GRPO module. The host provides ``versions`` (a
    :class:`~lit_llm.lightning.versions.PolicyVersionSwitch`), ``tokenizer``, ``chat_template``,
    ``chat_template_kwargs``, ``eval_rewards``
    (:class:`~lit_llm.rewards.RewardFunctions`), ``eval_metrics`` (a ``ModuleDict`` of ``MeanMetric`` per function),
    ``eval_max_new_tokens``, ``eval_samples`` and ``eval_step`` (the step rows and lines are labelled with: the
    loaded checkpoint's in ``validate``); for episodes also ``env_factory`` (``None``: single-turn), ``engine`` (the
    training :class:`~lit_llm.rollouts.EpisodeEngine`) and ``_eval_engines`` (a dict, the greedy engines by
    budget). ``eval_rewards`` may be ``None`` with an environment (its reward alone)."""

    # ------------------------------------------------------------------------------------------------- episodes
    def eval_engine(self) -> EpisodeEngine:
        """The :class:`~lit_llm.rollouts.EpisodeEngine` of greedy episodes: the training engine's episode settings
        (:attr:`~lit_llm.rollouts.EpisodeEngine.episode`) and rollout settings without a seed over the greedy version of
        ``eval_max_new_tokens`` (:meth:`~lit_llm.lightning.versions.PolicyVersionSwitch.greedy_version`); no reward
        functions, no sampling seed. Built once per budget. Its ``num_generations`` is the training engine's (the
        constructor needs a group size) but unused: :meth:`greedy_episodes` runs one episode per row."""
        budget = int(self.eval_max_new_tokens)
        engine = self._eval_engines.get(budget)
        if engine is None:
            train = self.engine
            engine = EpisodeEngine(self.versions.greedy_version(budget), tokenizer=self.tokenizer,
                                   settings=dataclasses.replace(train.settings, seed=None), episode=train.episode)
            self._eval_engines[budget] = engine
        return engine

    @torch.no_grad()
    def greedy_episodes(self, batch: dict[str, Any]) -> tuple[list[Trajectory], list[dict[str, Any]], list[Any]]:
        """One greedy episode per row of a prompt batch (fresh environments, eval mode, no grad).

        Returns:
            ``(trajectories, rows, envs)``: the :class:`~lit_llm.rollouts.Trajectory` of each row, the row itself
            (``{"prompt", "sample_id", <columns>}``, what ``env.reset`` got) and its (closed) environment.

        Raises:
            lit_llm.rollouts.RolloutError: a bad batch or an environment that fails (named), with a note naming the
                held-out row: ``"in episode i of n (prompt i, sample_id '...')"`` (``i``: the row's index in the
                batch).
        """
        prompts, sample_ids, columns = read_prompt_batch(batch)
        rows = [{"prompt": p, "sample_id": s, **{c: v[i] for c, v in columns.items()}}
                for i, (p, s) in enumerate(zip(prompts, sample_ids))]
        engine = self.eval_engine()
        envs = [engine.make_env() for _ in rows]
        self.versions.num_greedy_calls += 1
        with self.versions.generating():
            return engine.run_episodes(envs, rows, num_generations=1), rows, envs

    def episode_validation_step(self, batch: dict[str, Any]) -> None:
        """Greedy episodes of held-out rows: accumulate ``env_reward``, ``tool_call_rate``, ``turns`` and the
        evaluation reward functions over whole episodes; keep the first episodes for ``eval_samples.csv``."""
        trajs, rows, envs = self.greedy_episodes(batch)
        values = {"env_reward": [t.env_reward for t in trajs],
                  "tool_call_rate": [float(t.tool_calls > 0) for t in trajs], "turns": [float(t.turns) for t in trajs]}
        per_fn: dict[str, Tensor] = {}
        if self.eval_rewards is not None:
            columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "sample_id")}
            columns.setdefault("tools", [tool_schemas(getattr(env, "tools", None)) for env in envs])
            _, per_fn = self.eval_rewards(prompts=[t.messages[:t.num_prompt_messages] for t in trajs],
                                          completions=[t.completion_messages for t in trajs],
                                          completion_ids=[t.completion_ids.tolist() for t in trajs],
                                          trainer_state=self.versions.trainer_state(), **columns)
        for name, vals in values.items():
            self.eval_metrics[name].update(torch.tensor(vals, dtype=torch.float32, device=self.device))
        for name, vals in per_fn.items():
            self.eval_metrics[name].update(vals.to(self.device))
        room = self.eval_samples - len(self._eval_rows)
        for i in range(max(0, min(room, len(trajs)))):
            self._eval_rows.append(episode_sample_row(self.eval_step, rows[i]["sample_id"],
                                                      trajs[i].stats(self.engine.renderer),
                                                      [_reference(rows[i], envs[i])], [v[i] for v in per_fn.values()]))

    @torch.no_grad()
    def greedy_responses(self, batch: dict[str, Any]) -> list[Tensor]:
        """Greedy response ids (``eval_max_new_tokens``, ending with the stop token unless truncated) of a prompt
        batch's ``prompt_ids`` (or its ``prompt``, rendered with the chat template and ``chat_template_kwargs``)."""
        ids = batch.get("prompt_ids") or tokenize_prompts(batch["prompt"], self.tokenizer,
                                                          chat_template=self.chat_template,
                                                          chat_template_kwargs=self.chat_template_kwargs)
        return self.versions.greedy([torch.as_tensor(p) for p in ids], self.eval_max_new_tokens)

    def complete(self, batch: dict[str, Any]) -> list[str]:
        """Greedy completions of a prompt batch, decoded without special tokens (see :meth:`greedy_responses`)."""
        return [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in self.greedy_responses(batch)]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Greedy completions of held-out prompts, scored by ``eval_reward_funcs`` (accumulated per function; their
        ``trainer_state`` is the trainer's progress, :meth:`~lit_llm.lightning.versions.PolicyVersionSwitch.
        trainer_state`); with an environment, greedy episodes (:meth:`episode_validation_step`)."""
        if getattr(self, "env_factory", None) is not None:
            self.episode_validation_step(batch)
            return
        resp = self.greedy_responses(batch)
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in resp]
        prompts = list(batch["prompt"])
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(prompts, texts)]
        columns = {k: list(v) for k, v in batch.items() if k not in ("prompt", "prompt_ids", "sample_id")}
        _, per_fn = self.eval_rewards(prompts=prompts, completions=completions,
                                      completion_ids=[r.tolist() for r in resp],
                                      trainer_state=self.versions.trainer_state(), **columns)
        for name, values in per_fn.items():
            self.eval_metrics[name].update(values.to(self.device))
        room = self.eval_samples - len(self._eval_rows)
        answers = columns.get("answer", [""] * len(texts))
        for i in range(max(0, min(room, len(texts)))):
            self._eval_rows.append([self.eval_step, batch.get("sample_id", [""] * len(texts))[i], texts[i],
                                    str(answers[i])[-40:], *[round(float(per_fn[n][i]), 4) for n in per_fn]])

    def on_validation_epoch_end(self) -> None:
        """Log ``eval/<fn>`` means; during the sanity check (``num_sanity_val_steps: -1``) they go straight to the
        loggers at step 0, as the before-training numbers."""
        values = {f"eval/{n}": m.compute() for n, m in self.eval_metrics.items() if m.update_count > 0}
        for m in self.eval_metrics.values():
            m.reset()
        rows, self._eval_rows = self._eval_rows, []
        if not values:
            return
        if self.trainer.sanity_checking:
            if self.trainer.is_global_zero:
                for logger in self.trainer.loggers:
                    logger.log_metrics({k: float(v) for k, v in values.items()}, step=self.eval_step)
        else:
            # x value: the step evaluated (global_step while fitting, the checkpoint's step in validate / test)
            self.log_dict({**values, "step": float(self.eval_step)}, batch_size=1)
        if self.trainer.is_global_zero:
            has_bar = any(isinstance(cb, StepProgressBar) for cb in self.trainer.callbacks)
            if self.trainer.sanity_checking or not has_bar:
                # the bar prints the evaluation line from the logged metrics; the sanity check's values went to the
                # loggers directly (nothing for the bar to read), and without a bar this is the only report
                rank_zero_info(f"[step {self.eval_step}] greedy eval: " +
                               ", ".join(f"{k}={float(v):.3f}" for k, v in values.items()))
            if rows:
                names = [] if self.eval_rewards is None else self.eval_rewards.names
                if getattr(self, "env_factory", None) is not None:  # the training table's columns
                    columns = episode_sample_columns(["reference"], names)
                else:
                    columns = ["step", "sample_id", "completion", "reference", *names]
                append_csv(self.trainer, "eval_samples.csv", columns, rows)
                log_table(self.trainer, "eval/samples", columns, rows)


def _reference(row: dict[str, Any], env: Any) -> str:
    """What an episode is scored against, for the samples table: the row's ``answer``, else the columns the
    environment requires (``"secret=42"``)."""
    if "answer" in row:
        return str(row["answer"])[-40:]
    return ", ".join(f"{c}={row[c]}" for c in getattr(env, "required_columns", ()) or () if c in row)[-40:]
