"""The data options through the real ``lit-llm`` CLI (tiny model): SFT on a Parquet file of ``messages`` rows, and
``configs/sft_tiny.yaml`` (``format: arithmetic``) with ``--data.path`` failing with the fix instead of silently
training on arithmetic."""

from __future__ import annotations

import csv
from pathlib import Path

import datasets
import pytest

from lit_llm.lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
SFT_TINY = str(ROOT / "configs/sft_tiny.yaml")


def chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(n)]


def test_sft_on_a_parquet_file_of_messages(tmp_path, one_thread):
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(chats(12)).to_parquet(str(path))
    cli = main(["fit", "--config", SFT_TINY, "--data.format", "auto", "--data.path", str(path),
                "--data.eval_fraction", "0.25", "--trainer.default_root_dir", str(tmp_path / "run"),
                "--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--samples.num_samples", "0"])
    dm = cli.datamodule
    assert len(dm.train_samples) == 9 and len(dm.val_samples) == 3
    ids = {s.sample_id for s in dm.train_samples} | {s.sample_id for s in dm.val_samples}
    assert ids == {f"{path}:row {i}" for i in range(1, 13)}
    assert cli.trainer.global_step == 2
    (metrics,) = (tmp_path / "run").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert any(r.get("val/loss") for r in rows) and any(r.get("train/loss") for r in rows)


def test_sft_tiny_with_a_path_names_the_fix(tmp_path):
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(chats(4)).to_parquet(str(path))
    with pytest.raises((ValueError, SystemExit)) as exc:
        main(["fit", "--config", SFT_TINY, "--data.path", str(path), "--trainer.default_root_dir",
              str(tmp_path / "run")])
    text = str(exc.value) + str(exc.value.__context__ or "")
    assert "--data.format auto" in text, text
