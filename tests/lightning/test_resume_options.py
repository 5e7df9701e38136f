"""Nothing silently ignored (issue 13 item 5): LightningCLI's top-level --optimizer beside the module's optimizer, and a
resume with another optimizer class or another learning rate."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lit_llm.lightning.cli import main
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.sft import SFTModule

ROOT = Path(__file__).resolve().parents[2]


def _fit(tmp_path: Path, optimizer, *, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=optimizer, grad_clip=None)
    dm = SFTDataModule(format="arithmetic", num_samples=16, eval_limit=4, batch_size=4, max_length=48)
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, accelerator="cpu", devices=1, default_root_dir=tmp_path,
                      precision="32-true")
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def adamw_ckpt(tmp_path):
    trainer = _fit(tmp_path, partial(torch.optim.AdamW, lr=1e-3), max_steps=1)
    path = tmp_path / "step1.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["lit_llm_optimizers"] == ["torch.optim.adamw.AdamW"]
    return path


def test_resume_with_another_optimizer_names_both(tmp_path, adamw_ckpt):
    with pytest.raises(ValueError) as e:
        _fit(tmp_path, partial(torch.optim.SGD, lr=1e-3, momentum=0.9), max_steps=2, ckpt_path=str(adamw_ckpt))
    assert "torch.optim.sgd.SGD" in str(e.value) and "torch.optim.adamw.AdamW" in str(e.value)


def test_resume_with_another_lr_warns_and_keeps_the_saved_one(tmp_path, adamw_ckpt):
    with pytest.warns(UserWarning, match=r"configured learning rate 0.005 is ignored on resume.*lr is 0.001"):
        trainer = _fit(tmp_path, partial(torch.optim.AdamW, lr=5e-3), max_steps=2, ckpt_path=str(adamw_ckpt))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3)


def test_resume_with_the_same_optimizer_is_quiet(tmp_path, adamw_ckpt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, partial(torch.optim.AdamW, lr=1e-3), max_steps=2, ckpt_path=str(adamw_ckpt))
    assert trainer.global_step == 2
    assert not [w for w in caught if "learning rate" in str(w.message)]


def test_top_level_optimizer_beside_the_config_one_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"--optimizer torch.optim.SGD \(lr=0.1\) and model.init_args.optimizer "
                                         r"torch.optim.AdamW \(lr=0.003\)"):
        main(["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--optimizer", "torch.optim.SGD",
              "--optimizer.lr", "0.1", "--trainer.default_root_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # refused before anything was built or written


def test_top_level_optimizer_alone_is_moved_into_the_module(tmp_path):
    cli = main(["fit", "--model", "lit_llm.lightning.SFTModule", "--model.model", "tiny", "--data",
                "lit_llm.lightning.SFTDataModule", "--data.format", "arithmetic", "--data.num_samples", "16",
                "--data.batch_size", "8", "--data.max_length", "48", "--optimizer", "torch.optim.SGD",
                "--optimizer.lr", "0.1", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
                "--trainer.enable_progress_bar", "false", "--wandb", "false"])
    opt = cli.trainer.optimizers[0]
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.1
    assert cli.trainer.global_step == 1
    import yaml

    cfg = yaml.safe_load((tmp_path / "csv" / "version_0" / "config.yaml").read_text())
    assert cfg["model"]["init_args"]["optimizer"]["class_path"] == "torch.optim.SGD"
    assert cfg.get("optimizer") is None
