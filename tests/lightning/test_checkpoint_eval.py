"""A checkpoint due at an evaluation step is written after that evaluation (issue 14 item 7), so a run killed after
the save and resumed from it does not lose the evaluation."""

from __future__ import annotations

from functools import partial

import torch
from lightning.pytorch import Callback, Trainer

from lit_llm.lightning.callbacks import StepCheckpoint
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.sft import SFTModule


class Events(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.events.append(("eval", trainer.global_step))


class RecordingCheckpoint(StepCheckpoint):
    def __init__(self, events: Events, **kw) -> None:
        super().__init__(**kw)
        self.events = events

    def _save_checkpoint(self, trainer, filepath) -> None:
        self.events.events.append(("save", trainer.global_step))
        super()._save_checkpoint(trainer, filepath)


def _fit(tmp_path, events: Events, *, max_steps: int, val_every: int, ckpt_path=None) -> Trainer:
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    dm = SFTDataModule(format="arithmetic", num_samples=32, eval_limit=4, batch_size=4, max_length=48)
    ckpt = RecordingCheckpoint(events, dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True,
                               save_top_k=-1, filename="{step}", auto_insert_metric_name=False)
    trainer = Trainer(max_steps=max_steps, logger=False, callbacks=[events, ckpt], enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1, precision="32-true",
                      val_check_interval=val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      default_root_dir=tmp_path)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_save_waits_for_the_evaluation_due_at_the_same_step(tmp_path):
    events = Events()
    _fit(tmp_path, events, max_steps=6, val_every=3)
    saves = [s for k, s in events.events if k == "save"]
    assert sorted(set(saves)) == [2, 4, 6]
    order = events.events
    # Step 6 has both: the evaluation comes first. Steps 2 and 4 have no evaluation: saved at once.
    assert order.index(("eval", 6)) < order.index(("save", 6))
    assert order.index(("eval", 3)) > order.index(("save", 2))


def test_resumed_run_keeps_the_evaluation_of_the_checkpoint_step(tmp_path):
    first = Events()
    _fit(tmp_path, first, max_steps=4, val_every=2)
    assert ("eval", 2) in first.events and first.events.index(("eval", 2)) < first.events.index(("save", 2))
    second = Events()
    _fit(tmp_path, second, max_steps=4, val_every=2, ckpt_path=str(tmp_path / "ckpt" / "2.ckpt"))
    # The step-2 evaluation is in the first run's record (before its save); the resumed run goes on to step 4.
    assert [e for e in second.events if e[0] == "eval"] == [("eval", 4)]


def test_every_step_checkpoints_are_named_after_the_step_and_epoch_they_hold(tmp_path):
    """``every_n_train_steps=1``, ``save_top_k=-1``, Lightning's default name ``epoch={epoch}-step={step}``: one file
    per step, each holding the ``global_step`` and epoch of its name (2 batches an epoch: steps 3-4 are epoch 1; the
    evaluation at step 2 is not shared with step 3's save)."""
    torch.manual_seed(0)
    ckpt = StepCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(max_steps=4, logger=False, callbacks=[ckpt], enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", devices=1, precision="32-true",
                      val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      default_root_dir=tmp_path)
    trainer.fit(SFTModule("tiny"), SFTDataModule(format="arithmetic", num_samples=8, eval_limit=2, batch_size=4,
                                                 max_length=48))
    names = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert names == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=1-step=3.ckpt", "epoch=1-step=4.ckpt"]
    held = [torch.load(tmp_path / n, map_location="cpu", weights_only=False) for n in names]
    assert [(c["epoch"], c["global_step"]) for c in held] == [(0, 1), (0, 2), (1, 3), (1, 4)]
