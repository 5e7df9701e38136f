"""Text tables of a run: rows appended to a CSV file in the first logger's folder and, with a ``WandbLogger``, logged
as a wandb table (sampled completions, evaluation answers, validation samples)."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

__all__ = ["append_csv", "log_table"]


def append_csv(trainer: Trainer, name: str, columns: list[str], rows: list[list[Any]]) -> Path:
    """Append ``rows`` to ``<first logger's log_dir>/<name>`` (``trainer.default_root_dir`` without a logger); the
    header ``columns`` is written once, when the file is created. The file is flushed and fsynced.

    Returns:
        The path of the CSV file.
    """
    log_dir = trainer.loggers[0].log_dir if trainer.loggers and trainer.loggers[0].log_dir else \
        trainer.default_root_dir
    path = Path(log_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if new:
            w.writerow(columns)
        w.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    return path


def log_table(trainer: Trainer, key: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Log ``rows`` as the wandb table ``key`` at the current global step (no-op without a ``WandbLogger``)."""
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            logger.log_text(key=key, columns=columns, data=rows, step=trainer.global_step)
