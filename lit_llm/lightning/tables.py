"""Text tables of a run (sampled completions, evaluation answers, validation samples): rows appended to a CSV file in
the first logger's folder (the ``CSVLogger`` the CLI puts first) and logged to every logger that has tables."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

__all__ = ["append_csv", "log_table", "markdown_table"]


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


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """``rows`` as a Markdown table (``|`` and newlines in cells escaped), for loggers that take text."""

    def cell(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def log_table(trainer: Trainer, key: str, columns: list[str], rows: list[list[Any]]) -> list[str]:
    """Log ``rows`` as the table ``key`` at the current global step to every logger that has tables: a wandb table
    (``WandbLogger.log_text``), a Markdown text summary (``TensorBoardLogger``: ``add_text``). The CSV copy is
    :func:`append_csv`'s.

    Returns:
        The class names of the loggers that got the table.
    """
    got = []
    for logger in trainer.loggers:
        name = type(logger).__name__
        if name == "WandbLogger":
            logger.log_text(key=key, columns=columns, data=rows, step=trainer.global_step)
        elif name == "TensorBoardLogger":
            logger.experiment.add_text(key, markdown_table(columns, rows), global_step=trainer.global_step)
        else:
            continue
        got.append(name)
    return got
