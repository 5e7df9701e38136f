"""Greedy evaluation of a GRPO policy on held-out prompts: answers from the greedy version of the policy's generate
version (:meth:`~lit_llm.lightning.versions.PolicyVersionSwitch.greedy`), scored by the evaluation reward functions.

:class:`GreedyEvaluation` is mixed into :class:`~lit_llm.lightning.grpo.GRPOModule`: ``trainer.val_check_interval``
runs it every N steps; each ``eval_reward_funcs`` function's mean is logged as ``eval/<fn>`` (torchmetrics, synced
over ranks); with ``trainer.num_sanity_val_steps: -1`` the full evaluation also runs before training and is logged at
step 0 (the "before" number). The first completions go to ``eval_samples.csv`` (and a wandb table). Metrics are
logged at :attr:`eval_step` (``global_step``; the checkpoint's step in ``validate``); the line reporting them is the
:class:`~lit_llm.lightning.progress.StepProgressBar`'s, or ``[step N] greedy eval: ...`` when no such bar is
attached.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lit_llm.data.prompts import tokenize_prompts
from lit_llm.lightning.progress import StepProgressBar
from lit_llm.lightning.tables import append_csv, log_table

__all__ = ["GreedyEvaluation"]


class GreedyEvaluation:
    """Validation hooks of a GRPO module. The host provides ``versions`` (a
    :class:`~lit_llm.lightning.versions.PolicyVersionSwitch`), ``tokenizer``, ``chat_template``,
    ``chat_template_kwargs``, ``eval_rewards``
    (:class:`~lit_llm.rewards.RewardFunctions`), ``eval_metrics`` (a ``ModuleDict`` of ``MeanMetric`` per function),
    ``eval_max_new_tokens``, ``eval_samples`` and ``eval_step`` (the step rows and lines are labelled with: the
    loaded checkpoint's in ``validate``)."""

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
        trainer_state`)."""
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
            if not any(isinstance(cb, StepProgressBar) for cb in self.trainer.callbacks):
                # the bar prints the evaluation line; without it (enable_progress_bar false) this is the only report
                rank_zero_info(f"[step {self.eval_step}] greedy eval: " +
                               ", ".join(f"{k}={float(v):.3f}" for k, v in values.items()))
            if rows:
                columns = ["step", "sample_id", "completion", "reference", *self.eval_rewards.names]
                append_csv(self.trainer, "eval_samples.csv", columns, rows)
                log_table(self.trainer, "eval/samples", columns, rows)
