"""Loggers of the CLI (issue 14 item 2): trainer.logger keeps Lightning's meaning, CSV and W&B are added beside it,
W&B project / name / tags, and completion tables reach every logger that has tables."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lit_llm.lightning.cli import default_loggers, main

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str):
    return main(["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--trainer.max_steps", "2",
                 "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path), *extra])


def test_tensorboard_the_lightning_way_keeps_csv_and_wandb_and_gets_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = _run(tmp_path, "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
               "--trainer.logger.save_dir", str(tmp_path / "tb"), "--wandb", "true", "--wandb_project", "my-proj",
               "--wandb_name", "run-a", "--wandb_tags", "[x, y]")
    kinds = [type(lg) for lg in cli.trainer.loggers]
    assert kinds == [CSVLogger, TensorBoardLogger, WandbLogger]
    wb = cli.trainer.loggers[2]
    assert wb._project == "my-proj" and wb._name == "run-a" and wb._wandb_init["tags"] == ["x", "y"]
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").is_file()
    assert (tmp_path / "csv" / "version_0" / "samples.csv").is_file()  # tables: the CSV copy in the CSV folder
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(cli.trainer.loggers[1].log_dir)), size_guidance={"tensors": 0})
    acc.Reload()
    assert "val/samples/text_summary" in acc.Tags()["tensors"]  # the samples table as Markdown text
    assert "train/loss" in acc.Tags()["scalars"]


def test_logger_false_means_no_logger(tmp_path):
    cli = _run(tmp_path, "--trainer.logger", "false")
    assert cli.trainer.loggers == []


def test_csv_can_be_turned_off_and_wandb_off(tmp_path):
    cli = _run(tmp_path, "--csv", "false", "--wandb", "false", "--trainer.logger",
               "lightning.pytorch.loggers.TensorBoardLogger", "--trainer.logger.save_dir", str(tmp_path / "tb"))
    assert [type(lg) for lg in cli.trainer.loggers] == [TensorBoardLogger]


def test_default_loggers_do_not_duplicate(tmp_path):
    mine = CSVLogger(save_dir=str(tmp_path), name="mine")
    out = default_loggers(str(tmp_path), wandb=False, loggers=[mine])
    assert out == [mine]
