"""Callbacks: :class:`StepCheckpoint` (the CLI's checkpoints) and generated validation samples, logged as text
(console + ``samples.csv``) and as a wandb table."""

from __future__ import annotations

from typing import Any
from weakref import proxy

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_llm.lightning.sharded_save import remove_checkpoint, save_replacing, swaps
from lit_llm.lightning.tables import append_csv, log_table
from lit_llm.policy.sharding import is_sharded

__all__ = ["StepCheckpoint", "ValidationSamples", "validation_follows"]


def validation_follows(trainer: Trainer) -> bool:
    """Whether Lightning runs a validation with at least one batch right after the current training batch (its own
    decision, ``fit_loop.epoch_loop._should_check_val_fx``)."""
    val_batches = trainer.num_val_batches
    if not trainer.enable_validation or not (sum(val_batches) if isinstance(val_batches, list) else val_batches):
        return False
    loop = trainer.fit_loop
    try:
        return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    except (AttributeError, TypeError):  # a Lightning without this private helper: save at once, as before
        return False


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` always holds the final step.

    Lightning's own class writes ``last.ckpt`` at the end of training only if it never wrote one, so a run stopped by
    ``max_steps`` between two ``every_n_train_steps`` saves would leave ``last.ckpt`` some steps behind and
    ``--ckpt_path last`` would redo them. When an evaluation is due at a save step, the save waits for it (Lightning
    saves the checkpoint before the evaluation otherwise, and a run resumed from it skips that evaluation). The
    ``{step}`` / ``{epoch}`` of a file name are the trainer's optimizer steps done and epoch of the step just done
    (:meth:`_monitor_candidates`), so ``step=N`` holds ``global_step`` N. Under ``ModelParallelStrategy`` every
    save (every-N-steps, top-k, ``last.ckpt``, :class:`~lit_llm.lightning.graceful_stop.GracefulStop`'s) writes the
    checkpoint folder beside its place and swaps it in, and a removal renames it away first, so a killed process
    never leaves a half-written folder under a checkpoint's name (:mod:`lit_llm.lightning.sharded_save`). Same
    arguments as :class:`~lightning.pytorch.callbacks.ModelCheckpoint`.
    """

    _train_ended = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_ended = False
        super().on_train_start(trainer, pl_module)

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, torch.Tensor]:
        """Lightning's candidates (the logged metrics) with ``step`` = ``trainer.global_step`` and, during training,
        ``epoch`` = ``trainer.current_epoch``.

        Lightning takes them from the logged ``"step"`` / ``"epoch"``, which the policy modules log in their
        ``on_train_batch_end``: Lightning calls that after the callbacks' hook, where the every-N-steps save (and
        :class:`~lit_llm.lightning.graceful_stop.GracefulStop`'s) happen, so the names were one step behind and a
        save after an evaluation then shared its name with the next step's (overwritten). At ``on_train_end`` the
        logged epoch is kept: the fit loop has already counted the last epoch as done there (``current_epoch`` is
        one more than the last step's)."""
        candidates = super()._monitor_candidates(trainer)
        candidates["step"] = torch.tensor(trainer.global_step)
        if not self._train_ended:
            candidates["epoch"] = torch.tensor(trainer.current_epoch)
        return candidates

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Lightning's, except under ``ModelParallelStrategy``: the checkpoint is written into a sibling staging
        folder and swapped in at ``filepath`` once every rank has written it
        (:func:`~lit_llm.lightning.sharded_save.save_replacing`); the loggers hear of it after the swap."""
        if not swaps(trainer.strategy, filepath):
            super()._save_checkpoint(trainer, filepath)
            return
        save_replacing(trainer.strategy, filepath, lambda path: trainer.save_checkpoint(path, self.save_weights_only))
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Lightning's (the strategy removes it on rank 0), except under ``ModelParallelStrategy``: the folder is
        renamed to its staging name first (:func:`~lit_llm.lightning.sharded_save.remove_checkpoint`)."""
        if not swaps(trainer.strategy, filepath):
            super()._remove_checkpoint(trainer, filepath)
        elif trainer.is_global_zero:
            remove_checkpoint(filepath)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Save every ``every_n_train_steps`` steps, after the evaluation when one is due at the same step (so a run
        killed after the save and resumed from it never loses that evaluation)."""
        if (self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
                and validation_follows(trainer)):
            self._defer_save_until_validation = True  # ModelCheckpoint.on_validation_end saves it
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._train_ended = True
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)


class ValidationSamples(Callback):
    """After each validation run, greedily answer the first ``num_samples`` validation prompts and log them.

    The prompts are the validation samples' ``prompt_ids`` (the prompt rendered with the generation prompt, exactly
    the ids the model is trained to continue, DESIGN.md property 1). Rows ``(step, sample_id, prompt, completion,
    reference)`` go to the console, to ``samples.csv`` in the first logger's directory (appended; the CSV logger's
    ``metrics.csv`` only holds numbers) and, with a ``WandbLogger``, to a ``val/samples`` table. ``step`` is the
    module's ``eval_step`` (in ``validate --ckpt_path``: the checkpoint's step, not Lightning's 0). Runs on rank 0
    only (sharded training: every rank generates, rank 0 writes), and not during the sanity check.

    Args:
        num_samples: prompts to answer (0 disables the callback).
        max_new_tokens: generation budget per answer.
    """

    def __init__(self, num_samples: int = 4, max_new_tokens: int = 64) -> None:
        if num_samples < 0 or max_new_tokens < 1:
            raise ValueError(f"ValidationSamples: num_samples must be >= 0 and max_new_tokens >= 1, got "
                             f"{num_samples}, {max_new_tokens}.")
        self.num_samples, self.max_new_tokens = num_samples, max_new_tokens

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # sharded (FSDP2): generation gathers the weights, a collective: every rank generates, rank 0 writes
        sharded = is_sharded(getattr(pl_module, "model", None))
        if self.num_samples == 0 or trainer.sanity_checking or not (trainer.is_global_zero or sharded):
            return
        samples = getattr(trainer.datamodule, "val_samples", None) if trainer.datamodule is not None else None
        if not samples or not hasattr(pl_module, "generate"):
            return
        chosen = samples[: self.num_samples]
        outputs = pl_module.generate([s.prompt_ids for s in chosen], max_new_tokens=self.max_new_tokens)
        if not trainer.is_global_zero:
            return
        tok = pl_module.tokenizer
        step = getattr(pl_module, "eval_step", trainer.global_step)  # validate: the checkpoint's step, not 0
        rows = [[step, s.sample_id, tok.decode(s.prompt_ids), tok.decode(o, skip_special_tokens=True),
                 s.reference] for s, o in zip(chosen, outputs)]
        for step, sid, _, completion, reference in rows:
            rank_zero_info(f"[step {step}] {sid}\n  generated: {completion!r}\n  reference: {reference!r}")
        append_csv(trainer, "samples.csv", self.columns, rows)
        log_table(trainer, "val/samples", self.columns, rows)

    columns = ["step", "sample_id", "prompt", "completion", "reference"]
