"""The run view's progress (issue 14 item 1): a bar over max_steps with the run's ETA and key numbers, plain flushed
lines off a terminal, and the CLI adding it by default."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from tqdm import tqdm

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.progress import StepProgressBar, format_duration, key_metrics
from lit_llm.lightning.sft import SFTModule

ROOT = Path(__file__).resolve().parents[2]


def _fit(tmp_path: Path, bar: StepProgressBar, *, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    dm = SFTDataModule(format="arithmetic", num_samples=16, eval_limit=4, batch_size=4, max_length=48)
    trainer = Trainer(max_steps=max_steps, logger=False, callbacks=[bar], enable_model_summary=False,
                      accelerator="cpu", devices=1, default_root_dir=tmp_path, precision="32-true",
                      val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      enable_checkpointing=False)
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


def test_plain_lines_every_step_and_at_every_evaluation(tmp_path, capsys):
    _fit(tmp_path, StepProgressBar(plain=True), max_steps=6)  # 4 batches per epoch: the run spans 2 epochs
    lines = capsys.readouterr().out.splitlines()
    steps = [int(m.group(1)) for ln in lines if (m := re.match(r"\[step (\d+)/6\] \d+s elapsed", ln))
             and "evaluation" not in ln]
    assert steps == [1, 2, 3, 4, 5, 6]
    evals = [ln for ln in lines if "evaluation:" in ln]
    assert [ln.split("]")[0] for ln in evals] == ["[step 3/6", "[step 6/6"]
    assert all("val/loss" in ln for ln in evals)
    step_lines = [ln for ln in lines if ln.startswith("[step 5/6]") and "evaluation" not in ln]
    assert "ETA" in step_lines[0] and "| loss " in step_lines[0] and "val_loss" in step_lines[0]


def test_plain_lines_every_n_steps(tmp_path, capsys):
    _fit(tmp_path, StepProgressBar(plain=True, every_n_steps=4), max_steps=6)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[step") and "evaluation" not in ln]
    assert [ln.split("]")[0] for ln in lines] == ["[step 4/6", "[step 6/6"]  # every 4th, and the last


def test_bar_counts_optimizer_steps_over_max_steps_and_resumes(tmp_path):
    bar = StepProgressBar(plain=False)
    trainer = _fit(tmp_path, bar, max_steps=6)
    assert bar.train_progress_bar.total == 6 and bar.train_progress_bar.n == 6  # not reset at the epoch boundary
    assert "loss" in bar.train_progress_bar.postfix
    ckpt = tmp_path / "six.ckpt"
    trainer.save_checkpoint(ckpt)
    bar2 = StepProgressBar(plain=False)
    _fit(tmp_path, bar2, max_steps=8, ckpt_path=str(ckpt))
    assert bar2.train_progress_bar.initial == 6 and bar2.train_progress_bar.n == 8
    assert bar2.train_progress_bar.total == 8


def test_slow_steps_read_seconds_per_step():
    # Lightning's default format prints "0.00it/s" for a 30 s step; ours inverts the rate.
    text = tqdm.format_meter(3, 80, 90.0, bar_format=StepProgressBar.BAR_FORMAT, unit="step")
    assert "30.00s/step" in text and "3/80" in text


def test_key_metrics_pick_and_order():
    m = {"eval/strict_arithmetic_reward": torch.tensor(0.25), "reward": torch.tensor(0.5),
         "train/tokens_per_sec": 312.0, "train/entropy": 0.3}
    assert key_metrics(m) == {"reward": 0.5, "eval": 0.25, "tok/s": 312.0}
    assert format_duration(3 * 3600 + 125) == "3h02m" and format_duration(221) == "3m41s"
    assert format_duration(float("inf")) == "?"


def test_every_n_steps_is_checked():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        StepProgressBar(every_n_steps=0)


def test_cli_adds_the_bar_unless_disabled(tmp_path):
    from lit_llm.lightning.cli import main

    base = ["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--trainer.max_steps", "1",
            "--trainer.default_root_dir", str(tmp_path), "--trainer.val_check_interval", "1"]
    cli = main(base)
    assert any(isinstance(c, StepProgressBar) for c in cli.trainer.callbacks)
    cli = main([*base, "--trainer.enable_progress_bar", "false"])
    assert not any(isinstance(c, StepProgressBar) for c in cli.trainer.callbacks)


def test_shipped_tiny_config_prints_a_line_per_step_and_evaluation(tmp_path, capsys):
    """configs/sft_tiny.yaml as shipped (enable_progress_bar: true): off a terminal, the CLI's bar prints one line per
    optimizer step and one per evaluation."""
    from lit_llm.lightning.cli import main

    main(["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--trainer.max_steps", "4",
          "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("]")[0] for ln in lines if ln.startswith("[step") and "evaluation" not in ln] == \
        ["[step 1/4", "[step 2/4", "[step 3/4", "[step 4/4"]
    assert [ln.split("]")[0] for ln in lines if "] evaluation:" in ln] == ["[step 2/4", "[step 4/4"]


def test_grpo_config_prints_the_before_training_evaluation(tmp_path, capsys, caplog):
    """configs/grpo_tiny.yaml as shipped (progress bar on, num_sanity_val_steps -1): off a terminal the step-0 greedy
    evaluation is printed (its values go to the loggers directly, so the bar has nothing to print for it), then
    the bar's line for each later evaluation."""
    import logging

    from lit_llm.lightning.cli import main

    with caplog.at_level(logging.INFO):  # rank_zero_info: Lightning's logger, on stderr in a terminal run
        main(["fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.max_steps", "2",
              "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path), "--wandb", "false"])
    lines = capsys.readouterr().out.splitlines()
    before = [r.getMessage() for r in caplog.records if "greedy eval:" in r.getMessage()]
    assert len(before) == 1 and before[0].endswith(tuple("0123456789")) and "[step 0] greedy eval: eval/" in before[0]
    assert [ln.split("]")[0] for ln in lines if "] evaluation:" in ln] == ["[step 2/2"]
