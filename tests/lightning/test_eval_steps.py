"""One step convention across a run's outputs (review items 2, 3, 5): metrics.csv, progress lines and evaluations
all use ``global_step`` (optimizer steps done); ``validate`` logs and prints at the checkpoint's step; each
evaluation is reported by one line."""

from __future__ import annotations

import csv
import re
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.progress import StepProgressBar
from lit_llm.lightning.sft import SFTModule


def _parts(tmp_path: Path, plain: bool, **kw):
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    dm = SFTDataModule(format="arithmetic", num_samples=16, eval_limit=4, batch_size=4, max_length=48)
    trainer = Trainer(logger=CSVLogger(tmp_path, name="csv"), callbacks=[StepProgressBar(plain=plain)],
                      enable_model_summary=False, accelerator="cpu", devices=1, default_root_dir=tmp_path,
                      precision="32-true", val_check_interval=3, check_val_every_n_epoch=None,
                      num_sanity_val_steps=0, enable_checkpointing=False, log_every_n_steps=1, **kw)
    return module, dm, trainer


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_fit_then_validate_steps_agree(tmp_path, capsys):
    module, dm, trainer = _parts(tmp_path, plain=True, max_steps=4)
    trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    out = capsys.readouterr().out
    rows = _rows(tmp_path / "csv" / "version_0" / "metrics.csv")
    train_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    val_steps = [int(r["step"]) for r in rows if r.get("val/loss")]
    data_steps = [int(r["step"]) for r in rows if r.get("data/train_samples")]
    assert train_steps == [1, 2, 3, 4]  # the step after which the metrics hold, as the progress lines count
    assert val_steps == [3]  # the evaluation after 3 optimizer steps
    assert data_steps == [0]
    assert re.findall(r"^\[step (\d+)/4\] evaluation:", out, re.M) == ["3"]  # one line per evaluation

    module, dm, trainer = _parts(tmp_path, plain=True)
    trainer.validate(module, dm, ckpt_path=tmp_path / "last.ckpt")
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "evaluation:" in ln]
    assert re.match(r"^\[step 4\] evaluation: val/loss \d", line) and "elapsed" not in line and "ETA" not in line
    rows = _rows(tmp_path / "csv" / "version_1" / "metrics.csv")
    assert [r["step"] for r in rows] == ["4"] and rows[0]["val/loss"]  # at the checkpoint's step, no data row


def test_terminal_mode_prints_the_evaluation_line_through_tqdm(tmp_path, capsys):
    module, dm, trainer = _parts(tmp_path, plain=False, max_steps=3)
    trainer.fit(module, dm)
    out = capsys.readouterr().out
    assert len(re.findall(r"\[step 3/3\] evaluation: .*\| val/loss \d", out)) == 1
